"""The built-in platform plugins; each registers through the `fd.platforms` entry-point group like a third party."""
