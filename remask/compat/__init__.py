"""Signature-compatible entry points for scripts written against upstream repositories."""
