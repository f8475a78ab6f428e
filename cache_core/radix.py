"""A radix prefix tree over token pages: each edge is one page of token ids.

A node holds where its page lives (a device page, a host page, both, or neither while
descendants still hold copies), its chained storage hash, and LRU/lock bookkeeping.
Device copies are prefix-closed: eviction only takes device pages from the frontier.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PageKey = tuple[int, ...]


@dataclass(eq=False)
class Node:
    """One page of a cached prefix."""

    key: PageKey
    parent: Node | None
    hash: bytes = b""
    device_page: int | None = None
    host_page: int | None = None
    children: dict[PageKey, Node] = field(default_factory=dict)
    last_access: int = 0
    hits: int = 0
    lock: int = 0  # requests using this node: neither copy may be evicted
    io_lock: int = 0  # storage writes reading the host copy: it may not be evicted
    backup_failed: bool = False  # the host had no room when this page should have been backed up
    in_storage: bool = False
    detached: bool = False  # removed from the tree

    @property
    def on_device(self) -> bool:
        return self.device_page is not None

    @property
    def on_host(self) -> bool:
        return self.host_page is not None

    @property
    def cached(self) -> bool:
        return self.device_page is not None or self.host_page is not None


class RadixTree:
    """The prefix tree of one rank's cache."""

    def __init__(self) -> None:
        self.root = Node(key=(), parent=None)

    def match(self, pages: Sequence[PageKey]) -> list[Node]:
        """The longest run of nodes matching `pages` from the root that still hold a copy."""
        path: list[Node] = []
        node = self.root
        for key in pages:
            child = node.children.get(key)
            if child is None or not child.cached:
                break
            path.append(child)
            node = child
        return path

    def child(self, parent: Node, key: PageKey, page_hash: bytes) -> Node:
        """The child of `parent` for `key`, created empty if missing."""
        node = parent.children.get(key)
        if node is None:
            node = Node(key=key, parent=parent, hash=page_hash)
            parent.children[key] = node
        return node

    def prune(self, node: Node) -> None:
        """Remove `node` and empty ancestors that hold no copy, no children and no lock."""
        while node is not self.root and not node.cached and not node.children and node.lock == 0 and node.io_lock == 0:
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.detached = True
            node = parent

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_frontier(self) -> list[Node]:
        """Unlocked device pages with no device-resident child, least recently used first."""
        found = [n for n in self.nodes() if n.on_device and n.lock == 0
                 and not any(c.on_device for c in n.children.values())]
        return sorted(found, key=lambda n: n.last_access)

    def host_frontier(self) -> list[Node]:
        """Unlocked host pages with no host-resident child, least recently used first."""
        found = [n for n in self.nodes() if n.on_host and n.lock == 0 and n.io_lock == 0
                 and not any(c.on_host for c in n.children.values())]
        return sorted(found, key=lambda n: (n.on_device, n.last_access))  # host-only copies go first
