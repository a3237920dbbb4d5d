"""The one place the package version lives; setup.py reads it from here."""

__version__ = "0.20.0"
