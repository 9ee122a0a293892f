"""common/http/guard.py's rules on the headers browsers send: which Host names a keyless admin API
answers to, and which requests count as sent by a page of another origin."""

from __future__ import annotations

from kvferry.common.http.guard import CROSS_SITE, Hosts, cross_site, refusal


def test_a_keyless_api_answers_only_to_its_own_names_security() -> None:
    hosts = Hosts("127.0.0.1", ["Proxy.Internal"])
    for ok in ("localhost", "localhost:9000", "LOCALHOST:9000", "127.0.0.1:9000", "127.0.0.5", "[::1]:9000",
               "proxy.internal:9000"):
        assert hosts.allows(ok), ok
    for bad in ("evil:9000", "evil", "localhost.evil:9000", "127.0.0.1.evil", "", None, "10.0.0.5:9000"):
        assert not hosts.allows(bad), bad
    assert Hosts("10.0.0.5").allows("10.0.0.5:9000") and not Hosts("0.0.0.0").allows("0.0.0.0:9000")
    assert Hosts("[fd00::2]").allows("[fd00::2]:9000")


def test_cross_origin_browser_requests_are_cross_site_security() -> None:
    same = [(None, None, "localhost:9000"), ("http://localhost:9000", "same-origin", "localhost:9000"),
            ("http://localhost", None, "localhost:80"), ("https://p.example", None, "p.example:443"),
            ("http://[::1]:9000", None, "[::1]:9000"), (None, "none", "localhost:9000")]
    for origin, site, host in same:
        assert not cross_site(origin, site, host), (origin, site, host)
    other = [("http://evil.example", None, "localhost:9000"), ("null", None, "localhost:9000"),
             ("http://localhost:8888", "same-site", "localhost:9000"), (None, "cross-site", "localhost:9000"),
             (None, "same-site", "localhost:9000"), ("http://localhost:9001", None, "localhost:9000"),
             ("http://localhost:9000", None, None)]
    for origin, site, host in other:
        assert cross_site(origin, site, host), (origin, site, host)


def test_the_rule_refuses_rebinding_and_cross_site_changes_only_security() -> None:
    hosts = Hosts("127.0.0.1")
    assert refusal("GET", "evil:9000", "http://evil:9000", None, hosts) is not None  # rebinding: reads too
    assert refusal("GET", "evil:9000", None, None, None) is None  # a key guards it: any name
    assert refusal("POST", "localhost:9000", "http://evil.example", None, None) == CROSS_SITE
    assert refusal("GET", "localhost:9000", "http://evil.example", "cross-site", hosts) is None  # reads change nothing
    assert refusal("DELETE", "localhost:9000", None, None, hosts) is None  # curl
