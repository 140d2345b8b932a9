"""rope_ops' in-tree backends, installed as the package ``rope_ops_backends``.

Each registers through the entry-point group ``rope_ops.backends`` exactly as a third-party
package would (see pyproject.toml).
"""
