"""``dlrt cluster``: the three systems brought up, wired together, watched and stopped as one.

The one package above AutoPS, Infiniswap and Tiresias (none of them imports it; ``dlrt``'s
command imports it only for ``dlrt cluster``).

``config`` (the choices a user changes, from a TOML or YAML file), ``plan`` (the services'
command lines: pure), ``local`` (the embedded single-machine setup: processes recorded in a
state file), ``onray`` (the same services as detached Ray actors on an existing Ray
cluster), ``probe`` (whether a service answers), ``cli`` (``up``, ``down``, ``status``).
"""
