"""Build of the optional compiled codec (``rmq_async.protocol._cmessage``).

Project metadata lives in pyproject.toml. The extension is optional: when Cython is missing (and
no generated C file is present) or the C compiler fails, the build prints a warning and the
package installs with its pure-Python decoder, which ``rmq_async`` then uses by itself.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

HERE = os.path.dirname(os.path.abspath(__file__))
PYX = os.path.join("rmq_async", "protocol", "_cmessage.pyx")
GENERATED_C = os.path.join("rmq_async", "protocol", "_cmessage.c")
# Opt out entirely, e.g. to test the pure installation: RMQ_ASYNC_NO_EXTENSIONS=1 pip install .
SKIP = os.environ.get("RMQ_ASYNC_NO_EXTENSIONS", "") not in ("", "0")

BUILD_ERRORS = (CCompilerError, CompileError, ExecError, PlatformError, OSError)


def _warn(message: str) -> None:
    line = "*" * 78
    print(f"\n{line}\nWARNING: {message}\nrmq_async will use its pure-Python decoder.\n{line}\n",
          file=sys.stderr)


class OptionalBuildExt(build_ext):
    """``build_ext`` that turns a failed compilation into a warning.

    An extension that failed is dropped from the list, so nothing later (the in-place copy of an
    editable install, the list of outputs) looks for its missing file.
    """

    def run(self) -> None:
        try:
            super().run()
        except BUILD_ERRORS as exc:
            _warn(f"the compiled codec could not be built ({exc})")
            self.extensions = []

    def build_extensions(self) -> None:
        self._failed: set[str] = set()
        super().build_extensions()
        self.extensions = [ext for ext in self.extensions if ext.name not in self._failed]

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as exc:
            _warn(f"the compiled codec {ext.name} could not be built ({exc})")
            self._failed.add(ext.name)


def source_digest(path: str) -> str:
    """The digest of the codec's source that the built extension carries (``SOURCE_DIGEST``).

    :mod:`rmq_async.protocol.message` compares it with the ``.pyx`` installed beside the
    extension and does not use an extension built from another version of it.
    """
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _extensions() -> list[Extension]:
    if SKIP:
        return []
    ext = Extension("rmq_async.protocol._cmessage", [PYX], extra_compile_args=["-O2"]
                    if sys.platform != "win32" else [])
    try:
        from Cython.Build import cythonize
    except ImportError:
        if os.path.exists(os.path.join(HERE, GENERATED_C)):
            # Built from a C file generated earlier, from a source that may not be this .pyx:
            # no digest, so the import-time check has nothing to vouch for.
            ext.sources = [GENERATED_C]
            return [ext]
        _warn("Cython is not installed and there is no generated C file")
        return []
    # Translated from this .pyx now: the module carries its digest.
    ext.define_macros = [("RMQ_ASYNC_PYX_DIGEST", f'"{source_digest(os.path.join(HERE, PYX))}"')]
    try:
        return list(cythonize([ext], compiler_directives={"language_level": 3}, quiet=True))
    except Exception as exc:  # a Cython error must not stop the pure installation
        _warn(f"Cython could not translate {PYX} ({exc})")
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
