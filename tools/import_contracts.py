"""An import-linter contract type that import-linter lacks: no import loop between any
two modules of the given packages (its `acyclic_siblings` judges whole sub-packages, so
a package whose sub-packages lean on each other without a module loop fails it).
`make lint` runs it with the other contracts (pyproject.toml).
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AcyclicModulesContract(Contract):
    """Options: packages, the packages whose modules may not import each other in a loop."""

    type_name = "acyclic_modules"
    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        prefixes = tuple(self.packages)  # type: ignore[arg-type]
        modules = sorted(m for m in graph.modules if m.split(".")[0] in prefixes)
        loops = _loops(graph, set(modules))
        return ContractCheck(kept=not loops, warnings=[], metadata={"loops": loops})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for loop in check.metadata["loops"]:
            output.print_error(" -> ".join([*loop, loop[0]]))
            output.new_line()


def _loops(graph: ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def edges(m: str) -> list[str]:
        return sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules)

    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(edges(root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges(child))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found
