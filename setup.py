from setuptools import setup

setup(cffi_modules=["csrc/_build.py:ffibuilder"])
