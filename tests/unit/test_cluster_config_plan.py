"""``dlrt cluster``'s config file and the command lines it plans (``dlrt_cluster.config``, ``.plan``).

Each planned command line is parsed by the real CLI it is for, so a renamed option breaks
here and not at a user's ``dlrt cluster up``.
"""
from __future__ import annotations

import pytest

from dlrt.rayprocess import HOST_ID, NODE_IP, fill
from dlrt_cluster import plan
from dlrt_cluster.config import ClusterConfig, ConfigError, load


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_without_a_file():
    c = load(None)
    assert c == ClusterConfig()
    assert (c.autops.port, c.infiniswap.port, c.tiresias.port) == (5555, 7300, 8470)
    assert c.cluster.state_dir.endswith("/.dlrt/cluster")


def test_toml_and_yaml_say_the_same(tmp_path):
    toml = write(tmp_path, "c.toml", '[cluster]\nstate = "/srv/c"\nstart_timeout = 5\n'
                                     '[autops]\nport = 6000\nmax_aggregators = 4\nray_resource = "cpu_lender"\n'
                                     '[infiniswap]\nheadroom = "2G"\nargs = ["--slab-size", "64M"]\n'
                                     '[tiresias]\npolicy = "gittins"\n')
    yaml = write(tmp_path, "c.yaml", "cluster: {state: /srv/c, start_timeout: 5}\n"
                                     "autops: {port: 6000, max_aggregators: 4, ray_resource: cpu_lender}\n"
                                     "infiniswap: {headroom: 2G, args: [--slab-size, 64M]}\n"
                                     "tiresias: {policy: gittins}\n")
    a, b = load(toml), load(yaml)
    assert a == b
    assert a.cluster.start_timeout == 5.0 and a.autops.max_aggregators == 4
    assert a.infiniswap.args == ["--slab-size", "64M"] and a.tiresias.policy == "gittins"


@pytest.mark.parametrize("text, says", [
    ("[autops]\nprot = 1\n", "unknown key 'prot' in [autops] (known: port,"),
    ("[autopsx]\nport = 1\n", "unknown section [autopsx]"),
    ('[autops]\nport = "5555"\n', "[autops] port must be a number, got '5555'"),
    ("[autops]\nport = 70000\n", "[autops] port out of range: 70000"),
    ("[cluster]\nstart_timeout = 0\n", "[cluster] start_timeout must be above 0"),
    ("[tiresias]\nargs = \"--x\"\n", "[tiresias] args must be a list of strings"),
    ("[autops\nport = 1\n", "is not valid TOML"),
    ("autops = 3\n", "[autops] must be a table of keys"),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, text, says):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert says in str(err.value) and str(err.value).startswith(path) and "\n" not in str(err.value)


def test_a_missing_file_and_a_yaml_list_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load(str(tmp_path / "none.toml"))
    with pytest.raises(ConfigError, match="expected sections"):
        load(write(tmp_path, "l.yaml", "- 1\n- 2\n"))


def parse(service: plan.Service):
    """The planned command line parsed by its own CLI (after ``python -m MODULE``)."""
    import autops.cli
    import infiniswap.cli
    import tiresias.cli
    module = service.argv[2]
    args = service.argv[3:]
    if module == "autops.cli":
        return autops.cli._parser()[0].parse_args(args)
    if module == "infiniswap.cli":
        return infiniswap.cli._parser().parse_args(args)
    assert module == "tiresias.cli"
    return tiresias.cli._parser().parse_args(args)


def test_the_embedded_setup_is_wired_on_one_host(tmp_path):
    c = load(write(tmp_path, "c.toml", f'[cluster]\nstate = "{tmp_path}/st"\n[tiresias]\nnodes = "2x4"\n'
                                       '[autops]\nmax_aggregators = 3\n'))
    autops = plan.pmaster(c, "127.0.0.1")
    daemon = plan.daemon(c, "127.0.0.1", report_host="me")
    tiresias = plan.tiresias(c, "127.0.0.1", autops, [daemon], {n: "me" for n in plan.local_nodes("2x4")})
    a, d, t = parse(autops), parse(daemon), parse(tiresias)
    assert (a.provider, a.bind, a.report_bind, a.max_aggregators) == (
        "local", "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5557", 3)
    assert a.state_dir == f"{tmp_path}/st/autops"
    assert (d.bind, d.data_host, d.reports, d.report_host) == (
        "tcp://127.0.0.1:7300", "127.0.0.1", "tcp://127.0.0.1:5600", "me")
    assert t.executor == "local" and t.nodes == "2x4" and t.state == f"{tmp_path}/st/tiresias"
    assert t.autops_master == "tcp://127.0.0.1:5555" and t.autops_reports == ["tcp://127.0.0.1:5557"]
    assert t.infiniswap_reports == ["tcp://127.0.0.1:5600"]
    assert t.node_host == ["node0=me", "node1=me"]
    assert (autops.endpoint, daemon.endpoint, tiresias.endpoint) == (
        "tcp://127.0.0.1:5555", "tcp://127.0.0.1:7300", "http://127.0.0.1:8470")


def test_on_ray_pmaster_uses_the_ray_provider_and_daemons_fill_in_their_node():
    c = ClusterConfig()
    c = type(c)(autops=type(c.autops)(ray_resource="lender"), infiniswap=type(c.infiniswap)(capacity="4G"))
    autops = parse(plan.pmaster(c, "10.0.0.1", ray_address="10.0.0.1:6379"))
    assert (autops.provider, autops.ray_address, autops.ray_resource) == ("ray", "10.0.0.1:6379", "lender")
    daemon = plan.daemon(c, NODE_IP, name="infiniswap-abcd")
    argv = fill(daemon.argv, "10.0.0.3", "host-3")
    d = parse(plan.Service(daemon.name, daemon.kind, argv, "", ""))
    assert (d.bind, d.data_host, d.reports, d.report_host, d.capacity) == (
        "tcp://10.0.0.3:7300", "10.0.0.3", "tcp://10.0.0.3:5600", "host-3", 4 << 30)
    assert fill([daemon.endpoint], "10.0.0.3", "h") == ["tcp://10.0.0.3:7300"]
    assert HOST_ID in daemon.argv and daemon.log.endswith("infiniswap-abcd.log")


def test_tiresias_on_ray_maps_gpu_nodes_to_daemon_hosts_and_takes_extra_args():
    c = ClusterConfig()
    c = type(c)(tiresias=type(c.tiresias)(checkpoint_root="/shared/ckpt", args=["--interval", "2"]))
    autops = plan.pmaster(c, "10.0.0.1", ray_address="10.0.0.1:6379")
    daemons = [plan.Service(f"d{i}", plan.INFINISWAP, [], f"tcp://10.0.0.{i}:7300", "",
                            {"reports": f"tcp://10.0.0.{i}:5600"}) for i in (2, 3)]
    t = parse(plan.tiresias(c, "10.0.0.1", autops, daemons, {"gpu2": "h2", "gpu1": "h1"},
                            ray_address="10.0.0.1:6379"))
    assert (t.executor, t.ray_address, t.checkpoint_root, t.interval) == ("ray", "10.0.0.1:6379", "/shared/ckpt", 2.0)
    assert t.infiniswap_reports == ["tcp://10.0.0.2:5600", "tcp://10.0.0.3:5600"]
    assert t.node_host == ["gpu1=h1", "gpu2=h2"]


def test_fill_replaces_only_the_placeholders():
    assert fill(["--bind", "{node_ip}:1", "--host", "{host_id}", "{other}"], "10.1.1.1", "h") == [
        "--bind", "10.1.1.1:1", "--host", "h", "{other}"]
    assert plan.local_nodes("3x2") == ["node0", "node1", "node2"] and plan.local_nodes("bad") == []
