"""Builds fastkv: the Python package and its native parts."""

from setuptools import Extension, find_packages, setup

chain_hash = Extension(
    "fastkv._chain_hash",
    sources=["fastkv/_chain_hash.c"],
    libraries=["crypto"],
    extra_compile_args=["-O3"],
    optional=True,  # fastkv.hashing falls back to an equivalent pure-Python loop
)

setup(
    name="fastkv",
    version="0.1.0",
    description="PaddlePaddle-native hierarchical KV-cache manager for LLM serving",
    python_requires=">=3.11",
    packages=find_packages(include=["fastkv", "fastkv.*"]),
    install_requires=["numpy"],
    ext_modules=[chain_hash],
)
