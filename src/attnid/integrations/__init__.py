"""Integrations with training frameworks (imported explicitly; they need optional extras)."""
