"""Context drafts (prompt lookup) on the registry: no folder, no weights, no training; they draft alone or
merged into another method's tree (`--context-draft`)."""

from .. import Method, register

METHOD = register(Method(name="context", title="context drafts"))
