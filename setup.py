"""Package discovery only (everything else is in pyproject.toml).

``packages.find`` cannot discover ``diffusers_qvg.pipelines``, whose folder (``pipelines/``) is mapped by
``[tool.setuptools.package-dir]``; listing it here keeps every ``diffusers_qvg.*`` subpackage auto-found.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["diffusers_qvg", "diffusers_qvg.*"]) + ["diffusers_qvg.pipelines"])
