"""The server's session router without a model or a server: which session a
request's turn runs on, given the conversations the sessions hold. A stand-in
manager says which sessions exist; a stand-in shared map (the server store's
routes) stands for the Redis one (the store tests run the real one)."""

from __future__ import annotations

import pytest
from kvchat.serve.sessions import SessionRouter, namespace
from kvchat.tiers import StoreUnavailable

SYSTEM = {"role": "system", "content": "Be brief."}


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


class _Manager:
    """What the router asks of a manager: which sessions exist."""

    def __init__(self):
        self.held: set[str] = set()

    def sessions(self):
        return list(self.held)


@pytest.fixture
def manager():
    return _Manager()


@pytest.fixture
def router(manager):
    return SessionRouter(manager)


def _turn(router, manager, ns, messages, reply, explicit=None):
    """One successful turn: claimed, run (the manager now holds the session), released."""
    session = router.claim(ns, explicit, messages)
    manager.held.add(session)
    router.release(ns, session, [*messages, _assistant(reply)])
    return session


def test_a_conversation_continues_on_its_session(router, manager):
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    assert session.startswith("open/auto-")
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    assert _turn(router, manager, ns, second, "Sunny.") == session
    third = [*second, _assistant("Sunny."), _user("Tomorrow?")]
    assert router.claim(ns, None, third) == session


def _text_session(router, manager, ns, text):
    """A completion's session, idle and holding ``text``."""
    session = router.claim_text(ns, None, text)
    manager.held.add(session)
    router.release(ns, session, None)
    router.remember_text(ns, session, text)
    return session


def test_a_fork_of_an_older_point_never_takes_the_session_over(router, manager):
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    _turn(router, manager, ns, second, "Sunny.")
    # A regenerate of turn 2 and an edit of turn 1: the session holds a
    # longer conversation than either, so each starts a session of its own.
    assert router.claim(ns, None, second) != session
    assert router.claim(ns, None, [*first, _assistant("Hello!"), _user("Rain?")]) != session
    assert router.claim(ns, None, [SYSTEM, _user("Hey")]) != session


def test_two_requests_on_one_conversation_at_once_get_two_sessions(router, manager):
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    running = router.claim(ns, None, second)
    assert running == session
    assert router.claim(ns, None, second) != session  # claimed for the length of a turn


def test_a_failed_turn_leaves_the_session_where_it_was(router, manager):
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    assert router.claim(ns, None, second) == session
    router.release(ns, session, None)  # the turn failed: it holds what it held
    assert router.claim(ns, None, second) == session


def test_namespaces_never_see_each_others_sessions(router, manager):
    a, b = namespace("key-a"), namespace("key-b")
    assert a != b and a.startswith("key-") and "key-a" not in a  # a hash, not the key
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, a, first, "Hello!")
    assert session.startswith(f"{a}/")
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    other = router.claim(b, None, second)
    assert other != session and other.startswith(f"{b}/")
    assert SessionRouter.external(b, session) is None
    assert SessionRouter.external(a, session) == session.partition("/")[2]


def test_fields_a_client_adds_on_the_way_back_do_not_fork(router, manager):
    """The OpenAI SDK sends the reply back with refusal, annotations and None
    fields: the same conversation, so the same session."""
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    echoed = {**_assistant("Hello!"), "refusal": None, "annotations": [], "tool_calls": None}
    assert router.claim(ns, None, [*first, echoed, _user("Weather?")]) == session


def test_a_removed_session_is_forgotten_and_never_routed_to(router, manager):
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    manager.held.discard(session)  # expired, deleted or evicted for good
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    fresh = router.claim(ns, None, second)
    assert fresh != session
    assert session not in router.tracked()
    router.release(ns, fresh, None)  # its first turn was refused: nothing is kept
    assert router.tracked() == set()


def test_a_turn_by_id_takes_the_session_out_of_the_map_until_it_ends(router, manager):
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    explicit = SessionRouter.external(ns, session)
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    assert router.claim(ns, explicit, second) == session
    assert router.claim(ns, None, second) != session  # running: not found by messages
    router.release(ns, session, [*second, _assistant("Sunny.")])
    third = [*second, _assistant("Sunny."), _user("Tomorrow?")]
    assert router.claim(ns, None, third) == session


def test_overlapping_turns_leave_the_session_out_of_the_map(router, manager):
    """Two turns by id at once: which conversation it holds after is unknown,
    so no conversation routes to it (a turn by id still does)."""
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    explicit = SessionRouter.external(ns, session)
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    router.claim(ns, explicit, second)
    router.claim(ns, explicit, second)
    router.release(ns, session, [*second, _assistant("Sunny.")])
    router.release(ns, session, [*second, _assistant("Rain.")])
    for reply in ("Sunny.", "Rain."):
        assert router.claim(ns, None, [*second, _assistant(reply), _user("And?")]) != session
    assert router.claim(ns, explicit, second) == session


def test_text_completions_continue_the_longest_text_they_start_with(router, manager):
    ns = namespace(None)
    long = _text_session(router, manager, ns, "Once upon a time")
    short = _text_session(router, manager, ns, "Once")  # "Once" does not continue it
    assert long != short
    assert router.claim_text(ns, None, "Once upon a time there was") == long
    assert router.claim_text(ns, None, "Once more") == short
    assert router.claim_text(ns, None, "Twice") not in (long, short)


def test_a_text_in_another_namespace_is_never_continued(router, manager):
    ns = namespace(None)
    session = _text_session(router, manager, ns, "Once upon")
    assert router.claim_text(namespace("k"), None, "Once upon a time") != session
    assert router.claim_text(ns, None, "Once upon a time") == session


def test_the_longest_held_conversation_wins(router, manager):
    """Two idle sessions hold nested conversations: a request continuing the
    longer one goes to it, not to the one holding its prefix."""
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    short = _turn(router, manager, ns, first, "Hello!")
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    assert router.claim(ns, None, second) == short
    long = router.claim(ns, None, second)  # meanwhile, the same request again
    manager.held.add(long)
    router.release(ns, long, [*second, _assistant("Sunny.")])
    router.release(ns, short, None)  # the first one failed: it holds `first` again
    third = [*second, _assistant("Sunny."), _user("Tomorrow?")]
    assert router.claim(ns, None, third) == long
    assert router.claim(ns, None, second) == short


def test_conversations_that_differ_only_in_tool_calls_are_two(router, manager):
    ns = namespace(None)
    first = [SYSTEM, _user("Weather?")]
    call = {"role": "assistant", "content": None, "tool_calls": [_call("paris")]}
    session = router.claim(ns, None, first)
    manager.held.add(session)
    router.release(ns, session, [*first, call])
    other = {"role": "assistant", "content": None, "tool_calls": [_call("rome")]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert router.claim(ns, None, [*first, other, result]) != session
    assert router.claim(ns, None, [*first, call, result]) == session


def _call(city):
    arguments = f'{{"city": "{city}"}}'
    return {"id": "c1", "type": "function", "function": {"name": "w", "arguments": arguments}}


class _SharedRoutes:
    """A stand-in for the store's conversation map (ServerStore.routes)."""

    def __init__(self):
        self.map: dict[tuple[str, str], str] = {}  # (ns, digest) -> session
        self.down = False
        self.remembered: list[tuple[str, str, str]] = []

    def take(self, ns, digests):
        if self.down:
            raise StoreUnavailable("down")
        for digest in digests:
            session = self.map.pop((ns, digest), None)
            if session is not None:
                return session, digest
        return None

    def take_session(self, session):
        for key, held in list(self.map.items()):
            if held == session:
                del self.map[key]
                return True, key[1]
        return False, None

    def remember(self, ns, digest, session):
        self.remembered.append((ns, digest, session))
        self.map[(ns, digest)] = session


def test_a_shared_map_routes_a_conversation_this_replica_never_saw():
    routes = _SharedRoutes()
    one, two = _Manager(), _Manager()
    first_replica, second_replica = SessionRouter(one, routes), SessionRouter(two, routes)
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(first_replica, one, ns, first, "Hello!")
    assert routes.remembered[-1][2] == session
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    assert second_replica.claim(ns, None, second) == session  # the store's map routed it
    assert first_replica.claim(ns, None, second) != session  # taken out while its turn runs


def test_a_route_the_store_gives_from_another_namespace_is_not_taken():
    """The store's map is keyed by namespace; should it ever hand back another
    namespace's session, the router starts a new one rather than use it."""
    routes = _SharedRoutes()
    manager = _Manager()
    router = SessionRouter(manager, routes)
    first = [SYSTEM, _user("Hi")]
    foreign = _turn(router, manager, namespace("k"), first, "Hello!")
    routes.take = lambda ns, digests: (foreign, digests[0])  # a store that ignores ns
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    mine = router.claim(namespace(None), None, second)
    assert mine != foreign and mine.startswith(f"{namespace(None)}/")


def test_the_map_here_stands_in_while_the_store_is_down():
    routes = _SharedRoutes()
    manager = _Manager()
    router = SessionRouter(manager, routes)
    ns = namespace(None)
    first = [SYSTEM, _user("Hi")]
    session = _turn(router, manager, ns, first, "Hello!")
    routes.down = True
    second = [*first, _assistant("Hello!"), _user("Weather?")]
    assert router.claim(ns, None, second) == session
