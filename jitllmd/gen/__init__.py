"""Generated from proto/ by scripts/gen_proto.py: never edit by hand."""
