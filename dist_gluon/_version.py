"""The one version number: package metadata, ``dist_gluon.__version__``,
``dist-gluon-run --version`` and checkpoint metadata read it from here."""
__version__ = "0.3.0"
