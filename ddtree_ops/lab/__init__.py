"""The lab fleet: N local rehearsal hosts (systemd-nspawn containers) on a private bridge.

`fleet` owns the hosts' lifecycle, `image` the cached base image they boot from,
`cli` the `ddtree-ops lab` sub-commands. Nothing heavy is imported here so that the
main CLI stays fast.
"""
