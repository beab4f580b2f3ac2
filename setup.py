"""horovod-safusion: sparsification-ahead tensor fusion for Horovod + PyTorch."""
from setuptools import find_packages, setup

setup(
    name="horovod-safusion",
    version="0.1.0",
    description="SAFusion: tensor fusion with sparsification ahead, as a Horovod plugin",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_safusion", "horovod_safusion.*"]),
    python_requires=">=3.9",
    install_requires=["torch", "horovod==0.28.1", "numpy", "scipy", "numba", "tqdm"],
    extras_require={
        "bench": ["matplotlib", "scikit-learn"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "scikit-learn", "mpi4py", "triton==3.6.0"],
        "gpu": ["triton"],
    },
    entry_points={"console_scripts": ["horovod-safusion=horovod_safusion.__main__:main"]},
)
