"""mbolt: profile-guided expert layout for MoE GGUF files."""

__version__ = "0.2.0"
