"""Operations a model family composes, one home each (activation, attention, linear, norm, quant, rope), and the
quantization formats (formats.py); every layer picks its kernel once, when it is built. Import from the module."""
