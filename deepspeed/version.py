"""The one place the package version lives; setup.py reads it from here."""

__version__ = "0.20.0"


def _leading_int(part: str) -> int:
    digits = len(part) - len(part.lstrip("0123456789"))
    return int(part[:digits] or 0)


# Upstream's integer parts of the version (tools compare them): "0.20.0rc1" gives 0, 20, 0.
__version_major__, __version_minor__, __version_patch__ = (
    _leading_int(part) for part in (__version__.split(".") + ["0", "0"])[:3]
)
