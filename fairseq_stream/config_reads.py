"""fairseq's configuration read at Python speed while nothing writes it (fairseq-generate's output loop).

fairseq-generate's loop reads its OmegaConf configuration about 22 times a
sentence (``cfg.generation.nbest``, ``cfg.common_eval.post_process``,
``cfg.common_eval.quiet``, ...), and fairseq-interactive's as often. Each
attribute read walks omegaconf's node machinery (key validation, flags,
interpolation): together about a third of the parent's CPU under
``--cpu-workers``, where the parent shares the cores with the workers
(issue 50; benchmarks/bench_parent_cpu.py, measured in docs/threads.md).

:func:`remember_reads` makes every ``DictConfig`` node of a configuration
remember the values its attribute reads return, until anything writes,
copies or pickles any node of that configuration: the first such call puts
every node back as it was (its class ``DictConfig`` again, nothing
remembered) and then runs as omegaconf runs it. A value is only ever
remembered between two writes, so a read returns what omegaconf would
return, interpolations included (they are resolved against a configuration
that has not changed since). Reads by item (``cfg["x"]``), ``get``, ``keys``
and omegaconf's own functions run omegaconf's code unchanged.
"""

from typing import Any, Dict, List

from omegaconf import DictConfig, ListConfig

# Where a node keeps what it remembers, and the nodes forgotten together (in the node's own __dict__, as
# omegaconf keeps its content there; both keys are gone once the configuration is put back).
_MEMO = "_fairseq_stream_reads"
_GROUP = "_fairseq_stream_read_group"

# Every DictConfig method that changes a node, its children or its flags, or copies or serializes it
# (pickling must name DictConfig, not this module's class: a checkpoint or a spawned process reads it).
_RELEASING = (
    "__setattr__", "__setitem__", "__delattr__", "__delitem__", "pop", "setdefault",
    "_set_value", "_set_item_impl", "_wrap_value_and_set", "merge_with", "_merge_with",
    "merge_with_cli", "merge_with_dotlist", "__setstate__", "_set_flag", "_set_parent", "_set_key",
    "_set_flags_root", "_re_parent", "_promote", "_invalidate_flags_cache",
    "__copy__", "__deepcopy__", "copy", "__getstate__", "__reduce__", "__reduce_ex__",
)


class _Group:
    """The nodes of one configuration that remember reads; :meth:`release` puts them all back."""

    def __init__(self):
        self.nodes: List[DictConfig] = []

    def release(self):
        nodes, self.nodes = self.nodes, []
        for node in nodes:
            object.__setattr__(node, "__class__", DictConfig)
            node.__dict__.pop(_MEMO, None)
            node.__dict__.pop(_GROUP, None)


class RememberedReads(DictConfig):
    """A ``DictConfig`` node whose attribute reads are remembered until a write (see the module's text)."""

    def __getattr__(self, key: str) -> Any:
        memo: Dict[str, Any] = self.__dict__.get(_MEMO)
        if memo is None:  # put back by another thread's write between the lookup and here
            return DictConfig.__getattr__(self, key)
        try:
            return memo[key]
        except KeyError:
            value = DictConfig.__getattr__(self, key)  # a missing key raises here, and nothing is remembered
            memo[key] = value
            return value


def _releasing(name: str):
    def method(self, *args, **kwargs):
        group = self.__dict__.get(_GROUP)
        if group is not None:
            group.release()
        return getattr(DictConfig, name)(self, *args, **kwargs)  # the class is put back: omegaconf's own

    method.__name__ = name
    return method


for _name in _RELEASING:
    setattr(RememberedReads, _name, _releasing(_name))


def remember_reads(cfg) -> bool:
    """Make ``cfg``'s root configuration and every ``DictConfig`` node under it remember its attribute
    reads until the first write, copy or pickle of any of them; True where it did (``cfg`` is a node of
    an OmegaConf configuration whose nodes are all plain ``DictConfig``s, and none remembers yet)."""
    if type(cfg) is not DictConfig:
        return False
    root = cfg._get_root()
    nodes = _dict_nodes(root)
    if nodes is None:
        return False
    group = _Group()
    for node in nodes:
        node.__dict__[_MEMO] = {}
        node.__dict__[_GROUP] = group
        object.__setattr__(node, "__class__", RememberedReads)
        group.nodes.append(node)
    return True


def _dict_nodes(root) -> List[DictConfig]:
    """Every ``DictConfig`` node of the tree under ``root`` (through lists too), or None where one is not
    a plain ``DictConfig`` (a subclass of someone else's, or one remembering already)."""
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        if isinstance(node, DictConfig):
            if type(node) is not DictConfig:
                return None
            found.append(node)
            if node._is_none() or node._is_missing() or node._is_interpolation():
                continue
            children = node.__dict__["_content"].values()
        elif isinstance(node, ListConfig):
            if node._is_none() or node._is_missing() or node._is_interpolation():
                continue
            children = node.__dict__["_content"]
        else:
            continue
        stack.extend(child for child in children if isinstance(child, (DictConfig, ListConfig)))
    return found
