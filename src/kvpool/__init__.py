"""kvpool package."""
