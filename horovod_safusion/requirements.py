"""What this package needs of its environment, in one place: ``setup.py`` reads this file (without
importing the package) and ``horovod-safusion doctor`` checks the installed versions against it."""

#: The Horovod releases this package is tested with, as a PEP 440 specifier.
SUPPORTED_HOROVOD = ">=0.28.1,<0.29"
