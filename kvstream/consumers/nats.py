"""Reading batches back from NATS JetStream with a pull consumer.

``nats://HOST:PORT/SUBJECT?durable=NAME`` (nats-py, extra ``nats``). The
subscriber pulls messages of ``SUBJECT`` (default ``kv.events.>``: every
origin) in stream order, turns each back into its batch (codec from the
``Kv-Codec`` header, name from the ``Kv-*`` headers, see
:mod:`kvstream.wire.broker`), checks continuity per ``(origin, epoch)`` and
yields batches and :class:`~kvstream.consumers.base.Gap` items.

Acknowledgement: a message is acked once the caller has taken its batch and
asked for the next item, and on a clean :meth:`NatsSubscriber.aclose` (the
last batch handed over counts as consumed). A crash therefore re-delivers at
most the batches not yet acked: delivery is at least once, and within one
subscriber the tracker drops the repeats.

Where a new consumer starts is ``deliver`` (``all``, ``new`` or ``last``);
by default, as :func:`kvstream.config.subscribe` promises, live batches only
(``new``) unless the reader gives a ``from_seq`` (then ``all``, skipping each
origin's batches below it). With ``durable=NAME`` the consumer lives on the
server and a restarted subscriber resumes after the last batch acked under
that name, whatever ``deliver`` says. Every independent reader (each router)
needs its own name; readers sharing one share the messages. Without a durable
name the consumer is ephemeral. Either way, when the server goes away the
subscriber reconnects with backoff and continues after the last message it
handed over.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Final, Literal, Self

import anyio

from kvstream.codecs.base import Codec
from kvstream.consumers.base import Continuity, SequenceTracker, Subscriber, SubscriberItem
from kvstream.errors import ClosedError, ConfigError, DecodeError, KVStreamError, TransportError
from kvstream.wire.broker import (
    DEFAULT_SUBJECT_FILTER,
    HEADER_CODEC,
    FromSeq,
    PayloadDecoder,
    check_from_seq,
    check_subject,
    client_url,
    key_from_headers,
    start_seq,
)
from kvstream.wire.nats_client import (
    close_quietly,
    connect,
    describe_error,
    find_stream,
    require_nats,
    shown_url,
)

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js.client import JetStreamContext

    from kvstream.config import Options, ParsedURL

__all__ = ["NatsSubscriber", "subscriber_from_url"]

log = logging.getLogger("kvstream.consumers")

Deliver = Literal["all", "new", "last"]
DELIVER: Final[tuple[str, ...]] = ("all", "new", "last")
#: How long the server keeps an ephemeral consumer nobody pulls from.
_EPHEMERAL_IDLE: Final = 60.0


class NatsSubscriber(Subscriber):
    """Batches from a JetStream stream, in order, with gaps reported.

    ``subject``: the filter (wildcards allowed; default ``kv.events.>``).
    ``stream``: the stream to read (None: the one covering the subject).
    ``durable``: consumer name to resume from; None for an ephemeral consumer.
    ``deliver``: where a new consumer starts (default ``new``, or ``all`` when
    ``from_seq`` is given). ``from_seq`` (an int, or ``{origin: seq}`` with
    ``"*"`` for the others) skips, in the first epoch seen of each origin, the
    batches below it. ``follow=False`` stops once the subscriber has caught up
    with the stream. ``codec`` decodes messages that do not name their codec
    (default JSON).
    """

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        *,
        subject: str | None = None,
        stream: str | None = None,
        durable: str | None = None,
        deliver: Deliver | None = None,
        follow: bool = True,
        from_seq: FromSeq = None,
        codec: Codec | None = None,
        fetch_batch: int = 256,
        poll_interval: float = 1.0,
        ack_wait: float = 30.0,
        connect_timeout: float = 5.0,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
    ) -> None:
        require_nats()
        self.url = url
        self.shown = shown_url(url)
        self.subject = check_subject(
            subject or DEFAULT_SUBJECT_FILTER, wildcards=True, where=self.shown
        )
        from_seq = check_from_seq(from_seq, self.shown)
        if deliver is None:
            deliver = "new" if from_seq is None else "all"
        if deliver not in DELIVER:
            raise ConfigError(
                f"{self.shown}: deliver: expected one of {', '.join(DELIVER)}, got {deliver!r}"
            )
        if durable is not None and (not durable or any(c in durable for c in " .*>")):
            raise ConfigError(
                f"{self.shown}: durable: expected a name without spaces, dots, * or >, "
                f"got {durable!r}"
            )
        if type(fetch_batch) is not int or fetch_batch < 1:
            raise ConfigError(
                f"{self.shown}: fetch_batch: expected an int >= 1, got {fetch_batch!r}"
            )
        if not poll_interval > 0:
            raise ConfigError(
                f"{self.shown}: poll_interval: expected seconds > 0, got {poll_interval!r}"
            )
        self.stream = stream
        self.durable = durable
        self.deliver: Deliver = deliver
        self.follow = follow
        self.from_seq = from_seq
        self.decoder = PayloadDecoder(codec)
        self.fetch_batch = fetch_batch
        self.poll_interval = poll_interval
        self.ack_wait = ack_wait
        self.connect_timeout = connect_timeout
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self.tracker = SequenceTracker()
        #: Messages whose payload or headers did not decode (skipped, logged).
        self.bad_messages = 0
        #: Connections made after the first one.
        self.reconnects = 0
        self._client: Client | None = None
        self._psub: JetStreamContext.PullSubscription | None = None
        self._stream_name: str | None = None
        self._ack_all = True
        self._last_stream_seq: int | None = None
        self._lost = False
        self._fetch_scope: anyio.CancelScope | None = None
        self._gen: AsyncGenerator[SubscriberItem, None] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<NatsSubscriber {self.shown} subject={self.subject!r} durable={self.durable!r}>"

    @property
    def stream_name(self) -> str | None:
        """The stream being read (known once connected)."""
        return self._stream_name

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        if self._client is None:
            await self._connect()
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        scope = self._fetch_scope  # a fetch in another task: stop waiting
        if scope is not None:
            scope.cancel()
        gen, self._gen = self._gen, None
        with anyio.CancelScope(shield=True):
            try:
                if gen is not None:
                    try:
                        await gen.aclose()
                    except RuntimeError:  # being iterated in another task: it sees _closed
                        pass
            finally:
                client, self._client, self._psub = self._client, None, None
                await close_quietly(client)

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        if self._closed:
            raise ClosedError(f"{self!r}: the subscriber is closed")
        if self._gen is None:
            self._gen = self._read()
        return self._gen

    # -- connection ---------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._closed  # a call, so that type checkers do not assume it unchanged

    def _on_lost(self) -> None:
        self._lost = True
        scope = self._fetch_scope
        if scope is not None:
            scope.cancel()

    async def _connect(self) -> None:
        client = await connect(
            self.url,
            name="kvstream subscriber",
            connect_timeout=self.connect_timeout,
            on_lost=self._on_lost,
        )
        self._lost = False
        try:
            self._psub = await self._bind(client)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await close_quietly(client)
            raise
        self._client = client

    async def _bind(self, client: Client) -> JetStreamContext.PullSubscription:
        nats = require_nats()
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        info = await find_stream(client, self.subject, self.stream, self.shown)
        if info is None:
            which = (
                f"stream {self.stream!r} does not exist"
                if self.stream
                else (f"no JetStream stream covers subject {self.subject!r}")
            )
            raise ConfigError(
                f"{self.shown}: {which}; create it, or start a sink with ?create=true first"
            )
        stream: str = info.config.name
        self._stream_name = stream
        config = ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.subject,
            ack_policy=AckPolicy.ALL,
            ack_wait=self.ack_wait,
            max_ack_pending=max(4 * self.fetch_batch, 1024),
        )
        if self._last_stream_seq is not None:  # continue after what was handed over
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._last_stream_seq + 1
        else:
            config.deliver_policy = {
                "all": DeliverPolicy.ALL,
                "new": DeliverPolicy.NEW,
                "last": DeliverPolicy.LAST,
            }[self.deliver]
        if self.durable is None:
            config.inactive_threshold = max(_EPHEMERAL_IDLE, 10 * self.poll_interval)
        jsm = client.jsm()
        try:
            existing = None
            if self.durable is not None:
                try:
                    existing = await jsm.consumer_info(stream, self.durable)
                except nats.js.errors.NotFoundError:
                    existing = None
            if existing is not None:
                self._check_consumer(existing)
                name = self.durable
            else:
                created = await jsm.add_consumer(stream, config)
                name = created.name
                self._ack_all = True
            return await client.jetstream().pull_subscribe_bind(consumer=name, stream=stream)
        except nats.js.errors.APIError as exc:
            raise ConfigError(
                f"{self.shown}: cannot use consumer {self.durable or '(ephemeral)'} on stream "
                f"{stream!r}: {exc.description or describe_error(exc)}"
            ) from exc
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(
                f"{self.shown}: cannot set up the consumer: {describe_error(exc)}"
            ) from exc

    def _check_consumer(self, info: Any) -> None:
        config = info.config
        if config.deliver_subject:
            raise ConfigError(
                f"{self.shown}: durable {self.durable!r} is a push consumer; kvstream reads "
                f"with a pull consumer: choose another durable name"
            )
        if config.filter_subject not in (None, "", self.subject):
            raise ConfigError(
                f"{self.shown}: durable {self.durable!r} exists with filter subject "
                f"{config.filter_subject!r}, not {self.subject!r}; kvstream never changes an "
                f"existing consumer: choose another durable name or delete it"
            )
        policy = getattr(config.ack_policy, "value", config.ack_policy)
        if policy == "none":
            raise ConfigError(
                f"{self.shown}: durable {self.durable!r} has ack policy none; choose another name"
            )
        self._ack_all = policy == "all"

    async def _reconnect(self) -> None:
        client, self._client, self._psub = self._client, None, None
        await close_quietly(client)
        await self._connect()
        self.reconnects += 1

    # -- reading ------------------------------------------------------------------

    async def _fetch(self) -> list[Msg]:
        nats = require_nats()
        psub = self._psub
        if psub is None or self._lost:
            raise TransportError(f"{self.shown}: not connected")
        with anyio.CancelScope() as scope:
            self._fetch_scope = scope
            try:
                return await psub.fetch(batch=self.fetch_batch, timeout=self.poll_interval)
            except nats.errors.TimeoutError:
                return []
            except (nats.errors.Error, OSError) as exc:
                raise TransportError(f"{self.shown}: fetch failed: {describe_error(exc)}") from exc
            finally:
                self._fetch_scope = None
        raise TransportError(f"{self.shown}: connection lost")

    async def _ack(self, done: list[Msg]) -> None:
        """Acknowledge consumed messages (the last one alone under ack policy all)."""
        if not done:
            return
        targets = done[-1:] if self._ack_all else done
        done.clear()
        for msg in targets:
            try:
                await msg.ack()
            except Exception as exc:  # the connection went: the server re-delivers
                log.debug("%s: ack failed: %s", self.shown, describe_error(exc))
                return

    async def _nak(self, unread: deque[Msg]) -> None:
        """Give fetched messages nobody read back to the server, for the next reader."""
        while unread:
            msg = unread.popleft()
            try:
                await msg.nak()
            except Exception as exc:
                log.debug("%s: nak failed: %s", self.shown, describe_error(exc))
                return

    def _accept(self, msg: Msg) -> list[SubscriberItem]:
        """Decode one message and check continuity; [] when it is skipped."""
        try:
            self._last_stream_seq = msg.metadata.sequence.stream
            key = key_from_headers(msg.headers)
            assert msg.headers is not None
            batch = self.decoder.decode(msg.data, key, msg.headers.get(HEADER_CODEC))
        except (DecodeError, ValueError) as exc:
            self.bad_messages += 1
            log.warning("%s: message on %s skipped: %s", self.shown, msg.subject, exc)
            return []
        if self.from_seq is not None and self.tracker.position(batch.origin) is None:
            first = start_seq(self.from_seq, batch.origin)
            if first is not None and batch.seq < first:
                return []
        state, gap = self.tracker.check(batch)
        if state is Continuity.DUPLICATE:
            return []
        return [gap, batch] if gap is not None else [batch]

    async def _read(self) -> AsyncGenerator[SubscriberItem, None]:
        if self._client is None and not self._closed:
            await self._connect()  # a failure to start is raised as it is
        consumed: list[Msg] = []  # handed over, not yet acknowledged
        unread: deque[Msg] = deque()  # fetched, not yet handed over
        delay = self._retry_initial
        failures = 0
        try:
            while not self._closed:
                try:
                    if self._psub is None or self._lost:
                        consumed.clear()  # their acks died with the old connection
                        await self._reconnect()
                    await self._ack(consumed)
                    msgs = await self._fetch()
                except KVStreamError as exc:
                    if self._stopping():
                        break
                    if isinstance(exc, ConfigError) and failures == 0:
                        raise
                    if failures == 0:
                        log.warning("%s: %s; reconnecting with backoff", self.shown, exc)
                    failures += 1
                    self._lost = True
                    await anyio.sleep(delay)
                    delay = min(delay * 2, self._retry_max)
                    continue
                if failures:
                    log.warning("%s: reading again after %d failed attempts", self.shown, failures)
                    failures = 0
                    delay = self._retry_initial
                if not msgs:
                    if not self.follow:
                        break
                    continue
                unread.extend(msgs)
                while unread:
                    msg = unread.popleft()
                    items = self._accept(msg)
                    consumed.append(msg)
                    for item in items:
                        yield item
                if not self.follow and msgs[-1].metadata.num_pending == 0:
                    break
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                if not self._lost:
                    await self._ack(consumed)
                    await self._nak(unread)
                    client = self._client
                    if client is not None and client.is_connected:
                        try:
                            await client.flush(timeout=1)
                        except Exception as exc:
                            log.debug("%s: flush failed: %s", self.shown, describe_error(exc))


# -- URL factory (kvstream.config's _SUBSCRIBERS) -------------------------------------


def subscriber_from_url(parsed: ParsedURL, opts: Options, kwargs: dict[str, Any]) -> Subscriber:
    """``nats://HOST:PORT[/SUBJECT]?durable=NAME&stream=...&deliver=...`` -> NatsSubscriber."""
    from kvstream.config import make_codec

    codec_name = opts.pop_str("codec")
    if codec_name is not None:
        kwargs["codec"] = make_codec(codec_name, opts)
    deliver = opts.pop_str("deliver")
    if deliver is not None and deliver not in DELIVER:
        raise ConfigError(
            f"{parsed.raw}: option deliver: expected one of {', '.join(DELIVER)}, got {deliver!r}"
        )
    return NatsSubscriber(
        client_url(parsed.raw, parsed.scheme, 4222),
        subject=parsed.path or None,
        stream=opts.pop_str("stream") or None,
        durable=opts.pop_str("durable") or None,
        deliver=deliver,  # type: ignore[arg-type]
        follow=opts.pop_bool("follow", kwargs.pop("follow", True)),
        from_seq=opts.pop_int("from_seq", kwargs.pop("from_seq", None)),
        fetch_batch=opts.pop_int("fetch_batch", 256, minimum=1) or 256,
        poll_interval=opts.pop_float("poll_interval", 1.0) or 1.0,
        ack_wait=opts.pop_float("ack_wait", 30.0) or 30.0,
        connect_timeout=opts.pop_float("connect_timeout", 5.0) or 5.0,
        **kwargs,
    )
