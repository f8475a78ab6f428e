"""The radix prefix tree: matching, pruning and the eviction frontiers."""

from __future__ import annotations

from cache_core.radix import RadixTree


def chain(tree: RadixTree, keys: list[tuple[int, ...]], parent=None):
    node = parent or tree.root
    nodes = []
    for key in keys:
        node = tree.child(node, key, bytes(key))
        nodes.append(node)
    return nodes


def test_match_stops_at_the_first_uncached_node() -> None:
    tree = RadixTree()
    a, b, c = chain(tree, [(1,), (2,), (3,)])
    assert tree.match([(1,), (2,), (3,)]) == []  # nothing holds a copy yet
    a.device_page, b.host_page, c.device_page = 0, 0, 1
    assert tree.match([(1,), (2,), (3,), (4,)]) == [a, b, c]
    b.host_page = None
    assert tree.match([(1,), (2,), (3,)]) == [a]
    assert tree.match([(9,)]) == []


def test_child_is_created_once() -> None:
    tree = RadixTree()
    first = tree.child(tree.root, (1,), b"h")
    assert tree.child(tree.root, (1,), b"other") is first
    assert first.hash == b"h" and first.parent is tree.root


def test_prune_removes_empty_ancestors_up_to_a_cached_or_locked_one() -> None:
    tree = RadixTree()
    a, b, c = chain(tree, [(1,), (2,), (3,)])
    a.host_page = 0
    tree.prune(c)
    assert c.detached and b.detached and not a.detached
    assert a.children == {}
    d, e = chain(tree, [(4,), (5,)], parent=a)
    d.lock = 1
    tree.prune(e)
    assert e.detached and not d.detached
    d.lock, d.io_lock = 0, 1
    tree.prune(d)
    assert not d.detached
    d.io_lock = 0
    tree.prune(d)
    assert d.detached and not a.detached


def test_prune_keeps_a_node_with_children() -> None:
    tree = RadixTree()
    a, b = chain(tree, [(1,), (2,)])
    b.device_page = 3
    tree.prune(a)
    assert not a.detached and list(tree.nodes()) != []


def test_device_frontier_is_unlocked_leaves_lru_first() -> None:
    tree = RadixTree()
    a, b, c = chain(tree, [(1,), (2,), (3,)])
    (d,) = chain(tree, [(9,)], parent=a)
    for i, node in enumerate((a, b, c, d)):
        node.device_page = i
    c.last_access, d.last_access = 5, 3
    assert tree.device_frontier() == [d, c]
    c.lock = 1
    assert tree.device_frontier() == [d]
    c.device_page = None  # b has no device child any more
    b.last_access = 1
    assert tree.device_frontier() == [b, d]


def test_host_frontier_puts_host_only_copies_first() -> None:
    tree = RadixTree()
    a, b = chain(tree, [(1,), (2,)])
    (x,) = chain(tree, [(7,)])
    a.host_page, b.host_page, x.host_page = 0, 1, 2
    b.device_page = 0  # on both tiers
    b.last_access, x.last_access = 1, 10
    assert tree.host_frontier() == [x, b], "host-only copies go first, whatever their age"
    x.io_lock = 1
    assert tree.host_frontier() == [b]
    b.lock = 1
    assert tree.host_frontier() == []
