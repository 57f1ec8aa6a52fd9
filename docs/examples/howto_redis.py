"""How-to: point RedisStore at the Redis you run, and say what it must keep."""

import trio

from sessionactors.stores import RedisStore


async def main() -> None:
    # Nothing connects here: a store opens its connection on its first call, and checks
    # the server's persistence then, before anything is read or written.
    for url in [
        "redis://127.0.0.1:6379/0",
        "rediss://:secret@redis.example.com:6380/0",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
        "redis+sentinel://10.0.0.5:26379,10.0.0.6:26379/sessions",
    ]:
        store = RedisStore(url)
        print(f"{store!r} demands persistence={store.persistence!r}")

    # Accept appendfsync everysec (up to about a second lost on a machine crash) ...
    print(RedisStore("redis://127.0.0.1:6379/0", persistence="everysec").persistence)
    # ... or opt out for a test or a cache, in the code or in the URL.
    print(RedisStore("redis://127.0.0.1:6379/15?persistence=volatile").persistence)

    # Every acknowledged write waits until one replica has it (at most half a second,
    # else StoreNotReplicatedError), in the code or in the URL.
    store = RedisStore("redis+sentinel://10.0.0.5:26379/sessions", replicas=1, replica_timeout=0.5)
    print(f"waits for {store.replicas} replica(s), {store.replica_timeout} s at most")
    print(RedisStore("redis://127.0.0.1:6379/0?replicas=2").replicas)

    try:
        RedisStore("redis+sentinel://10.0.0.5:26379")
    except ValueError as exc:
        print(f"refused: {exc}")


if __name__ == "__main__":
    trio.run(main)
