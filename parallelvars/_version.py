"""The version of parallelvars: one number, read by the package, the writers and the build."""

__version__ = "0.1.0"
