"""The package version (a module of its own, imported by everything that prints it, so that the
package root, which imports the API lazily, is imported by nothing inside the package)."""

__version__ = "0.1.0"
