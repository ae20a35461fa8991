"""hardelete: safe hard deletion of unreferenced data in versioned object storage."""

__version__ = "0.1.0"
