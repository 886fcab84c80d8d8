"""The HTTP face of ladder: an OpenAI-compatible FastAPI server over the async engine."""
