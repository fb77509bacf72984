from setuptools import setup

setup(cffi_modules=["infiniswap/_build_core.py:ffibuilder"])
