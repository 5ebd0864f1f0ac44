"""The model under test and the data fed to it."""
