"""HTTP server over the engine with OpenAI's and Anthropic's APIs (`openm3 serve`; entry: `openm3.serve.cli.main`).

Needs the `serve` extra (fastapi, uvicorn; httpx for tests); importing this package does not import them.
"""

from .app import APIError, ModelBackend, TextStream, create_app

__all__ = ["APIError", "ModelBackend", "TextStream", "create_app"]
