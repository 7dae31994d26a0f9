"""division: memory-efficient training by activation compression (DIVISION and its peers)."""
__version__ = "0.1.0"
