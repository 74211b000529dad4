"""``gateway rules simulate``: recorded traffic replayed through a rule table.

``records`` reads access logs, ``simulate`` replays them on a virtual clock through the
real matcher and limiter with in-process counters, ``report`` says what each table did
and what changes between two tables.
"""
