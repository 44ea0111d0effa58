"""The one ASGI app: OpenAI, Anthropic and health routes over one engine catalog, served by hypercorn."""
