"""mbolt: profile-guided expert layout for MoE GGUF files."""

__version__ = "0.1.0"
