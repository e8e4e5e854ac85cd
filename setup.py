# Only the cffi extension lives here: cffi_modules cannot be declared in
# pyproject.toml. Everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["csrc/build_native.py:ffibuilder"])
