"""fairseq's configuration remembering its reads (fairseq_stream/config_reads.py): omegaconf's values, always.

A configuration built by fairseq's own parser from a real command line is
read key by key against a second one built from the same line and never
armed; every kind of write, copy and pickle is checked to put the nodes back
and to be seen by the reads after it; and ``task.build_generator`` (what
fairseq-generate and fairseq-interactive call before their output loops) is
checked to arm the configuration it is handed.
"""

import copy
import os
import pickle

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError

import fairseq_stream  # noqa: F401  (installs the glue)
from fairseq_stream.config_reads import RememberedReads, remember_reads

PLUGIN = os.path.dirname(os.path.abspath(fairseq_stream.__file__))


def fairseq_config(toy, *extra):
    """fairseq-generate's configuration for a var-stream command line on the toy, as fairseq builds it."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [str(toy.data_bin), "--path", str(toy.transformer), "--user-dir", PLUGIN, "--search", "var-stream",
            "--beam", "5", "--batch-size", "4", "--gen-subset", "test", "--cpu"] + list(extra)
    return convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), argv))


def every_read(node, path=""):
    """(dotted key, value read by attribute) of every key under ``node``, containers as their keys."""
    out = []
    for key in node.keys():
        value = getattr(node, key)
        name = path + str(key)
        if isinstance(value, DictConfig):
            out.append((name, sorted(value.keys())))
            out.extend(every_read(value, name + "."))
        elif isinstance(value, ListConfig):
            out.append((name, OmegaConf.to_container(value)))
        else:
            out.append((name, value))
    return out


def armed(cfg):
    return type(cfg) is RememberedReads


@pytest.fixture(scope="module")
def configs(toy):
    return fairseq_config(toy), fairseq_config(toy)


def test_reads_are_omegaconfs_twice_over(configs):
    plain, remembering = configs
    assert remember_reads(remembering.generation)  # any node arms its whole configuration
    assert armed(remembering) and armed(remembering.common_eval)
    first = every_read(remembering)
    assert first == every_read(plain)
    assert every_read(remembering) == first  # now from memory
    assert armed(remembering)  # reading puts nothing back


def test_a_missing_key_raises_as_omegaconf_does_and_is_not_remembered(toy):
    cfg = fairseq_config(toy)
    remember_reads(cfg)
    for _ in range(2):
        with pytest.raises(ConfigAttributeError):
            cfg.generation.no_such_option
    assert armed(cfg)


WRITES = {
    "setattr": lambda cfg: setattr(cfg.dataset, "batch_size", 7),
    "setitem": lambda cfg: cfg.dataset.__setitem__("batch_size", 7),
    "update": lambda cfg: OmegaConf.update(cfg, "dataset.batch_size", 7),
    "merge": lambda cfg: cfg.merge_with({"dataset": {"batch_size": 7}}),
    "dotlist": lambda cfg: cfg.merge_with_dotlist(["dataset.batch_size=7"]),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_anywhere_puts_every_node_back_and_is_read(toy, write):
    cfg = fairseq_config(toy)
    remember_reads(cfg)
    assert cfg.dataset.batch_size == 4 and cfg.generation.beam == 5
    WRITES[write](cfg)
    assert not armed(cfg) and not armed(cfg.dataset) and not armed(cfg.generation)
    assert cfg.dataset.batch_size == 7
    assert not any(k.startswith("_fairseq_stream") for k in cfg.dataset.__dict__)


def test_new_keys_and_deletions_are_seen(toy):
    cfg = fairseq_config(toy)
    remember_reads(cfg)
    with open_dict(cfg):
        cfg.generation.added = 3
    assert cfg.generation.added == 3 and not armed(cfg)
    remember_reads(cfg)
    with open_dict(cfg):
        del cfg.generation["added"]
    with pytest.raises(ConfigAttributeError):
        cfg.generation.added


def test_interpolations_follow_what_they_point_at():
    cfg = OmegaConf.create({"a": {"x": 1}, "b": {"y": "${a.x}"}, "c": [{"z": "${a.x}"}]})
    remember_reads(cfg)
    assert cfg.b.y == 1 and cfg.c[0].z == 1
    assert armed(cfg.c[0])  # dictionaries inside lists remember too
    cfg.a.x = 2
    assert cfg.b.y == 2 and cfg.c[0].z == 2


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_copies_and_pickles_are_plain_omegaconf(toy, how):
    cfg = fairseq_config(toy)
    remember_reads(cfg)
    cfg.generation.beam  # something remembered
    if how == "pickle":
        blob = pickle.dumps(cfg)
        assert b"RememberedReads" not in blob and b"config_reads" not in blob  # loads without this plugin
        other = pickle.loads(blob)
    else:
        other = getattr(copy, how)(cfg)
    assert type(other) is DictConfig and type(cfg) is DictConfig
    assert every_read(other) == every_read(cfg)


def test_arming_twice_or_a_non_config_does_nothing(toy):
    cfg = fairseq_config(toy)
    assert remember_reads(cfg)
    assert not remember_reads(cfg)  # already armed: one group per configuration
    assert not remember_reads(None) and not remember_reads({"a": 1})


def test_build_generator_arms_the_configuration_before_the_output_loop(toy, loaded):
    models, task = loaded("transformer")
    cfg = fairseq_config(toy)
    generator = task.build_generator(models, cfg.generation)
    assert generator is not None
    assert armed(cfg) and armed(cfg.common_eval)
    cfg.dataset.batch_size = 2  # and a write after it still lands
    assert cfg.dataset.batch_size == 2 and not armed(cfg)
