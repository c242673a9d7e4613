"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions:``): gradhooks' docstrings are
written with reST roles (``:func:`attach```, ``:class:`~gradhooks.X```) and ``::`` literal
blocks; Markdown has neither, so the roles become code spans (the last dotted part for ``~``)
and ``Text::`` becomes ``Text:`` before the docstring is rendered. Not a documentation page."""
import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|ref):`(~?)([^`]+)`")


def _role(m):
    tilde, target = m.group(1), m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class ReSTRoles(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        doc = obj.docstring
        if doc is not None:
            text = ROLE.sub(_role, doc.value)
            doc.value = re.sub(r"(\S)::\n", r"\1:\n", text)
