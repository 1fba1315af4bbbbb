"""The optional C extension (csrc/native.c); everything else is declared in pyproject.toml.

``optional=True``: where no C compiler or OpenSSL headers are found the package installs without
it and runs the same loops in Python (gds_kv_connector/native.py says which is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("gds_kv_connector._native", ["csrc/native.c"], libraries=["crypto"],
                           extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
                           py_limited_api=True, optional=True)],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
