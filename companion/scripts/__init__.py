"""Standalone scripts. Each file imports only torch and the standard library."""
