"""openm3: an open implementation of the system MiniMax described for its M3 model."""

__version__ = "0.1.0"
