"""The session: what every transport that crosses a process boundary does the same way, written once.

A *session* is the life of one worker as a master sees it, and of one master as a worker sees it: hello and
welcome, admission, heartbeats, loss, joins and goodbye, over a *link* that moves frames and nothing else
(:mod:`transports.session.link`). Which file does what: docs/writing-a-transport.md.
"""
