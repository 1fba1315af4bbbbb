"""The optional C extension (csrc/native.c) and the packaging of the CUDA kernel source; everything
else is declared in pyproject.toml.

``optional=True``: where no C compiler or OpenSSL headers are found the package installs without
it and runs the same loops in Python (gds_kv_connector/format/native.py says which is in use).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

KERNEL = os.path.join("csrc", "checksum.cu")


class BuildPyWithKernel(build_py):
    """Puts csrc/checksum.cu into the built package as ``_csrc/checksum.cu``, where a wheel install's
    workers compile it with NVRTC: the checkout keeps one copy of the kernel, not a tracked twin."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):  # the attribute is new in setuptools 64  # an editable install reads csrc/ in the checkout itself
            target = os.path.join(self.build_lib, "gds_kv_connector", "_csrc")
            self.mkpath(target)
            self.copy_file(KERNEL, target)


setup(
    ext_modules=[Extension("gds_kv_connector._native", ["csrc/native.c"], libraries=["crypto"],
                           extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
                           py_limited_api=True, optional=True)],
    cmdclass={"build_py": BuildPyWithKernel},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
