"""The host agent: `remote/` runs on hosts (stdlib only); `shipping` and `client` are the control side.

    from ddtree_ops.agent.client import call_agent
    facts = call_agent(session, "facts", {"state_dir": host.state_dir, ...})
"""
