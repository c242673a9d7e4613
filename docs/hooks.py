"""mkdocs hooks (mkdocs.yml, ``hooks:``): the docs pages link to repository files with
``../path`` links so that they work on GitHub; in the built site those files are served under
``repo/`` and the links are rewritten to point there. Not a documentation page."""
import os
import re

from mkdocs.structure.files import File, InclusionLevel

# ](../path) or ](../path#anchor), the target a file of the repository outside docs/.
LINK = re.compile(r"\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")


def _targets(docs_dir):
    root = os.path.dirname(os.path.abspath(docs_dir))
    found = set()
    for name in sorted(os.listdir(docs_dir)):
        if name.endswith(".md"):
            with open(os.path.join(docs_dir, name), encoding="utf-8") as f:
                for m in LINK.finditer(f.read()):
                    path = m.group(1)
                    if os.path.isfile(os.path.join(root, path)) and not path.startswith("docs/"):
                        found.add(path)
    return root, found


def on_files(files, config):
    root, found = _targets(config["docs_dir"])
    for path in sorted(found):
        files.append(File.generated(config, "repo/" + path, abs_src_path=os.path.join(root, path),
                                    inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown, page, config, files):
    root = os.path.dirname(os.path.abspath(config["docs_dir"]))

    def repl(m):
        path, anchor = m.group(1), m.group(2) or ""
        if os.path.isfile(os.path.join(root, path)) and not path.startswith("docs/"):
            return f"](repo/{path}{anchor})"
        return m.group(0)

    return LINK.sub(repl, markdown)
