"""horovod-safusion: sparsification-ahead tensor fusion for Horovod + PyTorch."""
import ast
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _constants(path):
    """The module-level constants of ``path`` (plain names bound to literals), read without
    importing the package (which needs torch and Horovod), so that the package and its metadata
    name the same versions."""
    with open(os.path.join(HERE, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            found.update((t.id, value) for t in node.targets)
    return found


REQUIREMENTS = _constants(os.path.join("horovod_safusion", "requirements.py"))
VERSION = _constants(os.path.join("horovod_safusion", "__init__.py"))["__version__"]
README = os.path.join(HERE, "README.md")

setup(
    name="horovod-safusion",
    version=VERSION,
    description="SAFusion: tensor fusion with sparsification ahead, as a Horovod plugin",
    long_description=open(README, encoding="utf-8").read() if os.path.exists(README) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_safusion", "horovod_safusion.*"]),
    python_requires=">=3.9",
    # A range, not a pin: pip keeps a Horovod that is already built (against the user's torch,
    # with NCCL) instead of building one from the sdist.
    # packaging: horovod-safusion doctor compares versions (Horovod needs it too)
    install_requires=["torch", "horovod" + REQUIREMENTS["SUPPORTED_HOROVOD"], "numpy", "scipy", "numba", "tqdm",
                      "packaging"],
    extras_require={
        "bench": ["matplotlib", "scikit-learn"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "scikit-learn", "mpi4py", "triton==3.6.0"],
        "gpu": ["triton"],
    },
    entry_points={"console_scripts": ["horovod-safusion=horovod_safusion.__main__:main"]},
)
