/* The ledger's wire protocol: how the layer, in a container's process, reaches the daemon that keeps its slices'
 * ledger. src/gpuppetti/layer/ledger.py is the other side and speaks exactly this; keep the two together.
 *
 * One Unix stream socket per allocation (a device plugin Allocate, a DRA claim's request), ledger.sock in a
 * directory the daemon owns and the container mounts read-only: connect() works through a read-only mount, and a
 * directory (not a single-file bind mount) sees the socket a restarted daemon binds anew. GPUPPETTI_VK_LEDGER names
 * it inside the container.
 *
 * Each process holds a connection of its own (a forked child opens its own): what a connection holds is released
 * when it closes, so a process that dies, however it dies, gives its memory back at once.
 *
 * A daemon that restarts closes every connection. A process that holds memory watches its connection (a thread that
 * polls it for the peer's hang-up, reading nothing) and reconnects as soon as the socket is back, then declares what
 * it holds (DECLARE, DECLARE_HOLD); a ledger served again after a restart answers no RESERVE or HOLD for its first
 * two seconds, so that what the earlier processes hold is declared before a newcomer is answered.
 *
 * Every request is one struct ledger_request, little-endian (the daemon and the layer run on one machine). HELLO
 * comes first; its answer is a struct ledger_answer followed by `count` struct ledger_slice_terms, with one file
 * descriptor passed beside the answer's first byte (SCM_RIGHTS): the allocation's shared page (struct
 * ledger_shared), a memfd sealed against growing, shrinking and further seals. RESERVE and HOLD are answered with
 * one struct ledger_answer; the other requests are not answered (the layer never waits for them). A request the
 * daemon does not understand closes the connection.
 */
#ifndef GPUPPETTI_LEDGER_PROTOCOL_H
#define GPUPPETTI_LEDGER_PROTOCOL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define LEDGER_VERSION 1
#define LEDGER_MAX_SLICES 64
#define LEDGER_HEAPS 16

enum ledger_op {
    /* size: LEDGER_VERSION. Answered: status OK, count = the allocation's slices, value = the shared page's size. */
    LEDGER_HELLO = 1,
    /* Reserve size bytes of slice's heap for this connection before the driver is asked for them. Answered: OK, or
     * REFUSED where the slice's ledger would pass its budget; value = what the slice holds after it. */
    LEDGER_RESERVE = 2,
    /* Give back size bytes of slice's heap that this connection holds (at most what it holds). */
    LEDGER_RELEASE = 3,
    /* size bytes this connection holds on slice's heap were exported as the object (key_dev, key_ino): the st_dev
     * and st_ino of the exported file descriptor, the same in every process that holds it. They are charged once,
     * to the object, while any connection holds it; this one holds it now. */
    LEDGER_EXPORT = 4,
    /* This connection imported the object (key_dev, key_ino): it holds it too. Answered: OK where the object is
     * the slice's (exported by one of its processes), REFUSED where the ledger does not know it (someone else's
     * memory, not counted). */
    LEDGER_HOLD = 5,
    /* This connection no longer holds the object (it freed its handle); an object no one holds is uncharged. */
    LEDGER_UNHOLD = 6,
    /* After a reconnect: this connection already holds size bytes of slice's heap (allocated while the daemon was
     * away or before it restarted); counted without a budget check, as the memory exists. */
    LEDGER_DECLARE = 7,
    /* After a reconnect: this connection holds the object (key_dev, key_ino) of size bytes of slice's heap; created
     * (and charged) where the ledger does not know it, joined where it does. */
    LEDGER_DECLARE_HOLD = 8,
};

enum ledger_status {
    LEDGER_OK = 0,
    LEDGER_REFUSED = 1,
};

struct ledger_request {
    uint32_t op;
    uint32_t slice;    /* index into GPUPPETTI_VK_SLICES */
    uint32_t heap;     /* < LEDGER_HEAPS */
    uint32_t zero;     /* 0 */
    uint64_t size;
    uint64_t key_dev;  /* an exported object's st_dev */
    uint64_t key_ino;  /* and st_ino */
};

struct ledger_answer {
    uint32_t status;
    uint32_t count;
    uint64_t value;
};

/* HELLO's answer names each slice's terms, as the daemon holds them (its own, whatever the environment says). */
struct ledger_slice_terms {
    int64_t budget;   /* bytes; 0: a whole GPU, not limited */
    int64_t compute;  /* thousandths of the GPU's time; 1000: not throttled; 0: not known to the daemon (the
                       * container's GPUPPETTI_VK_COMPUTE is what throttles, either way) */
};

/* The shared page, per allocation. The daemon writes what each slice holds (after every change, before it answers);
 * the layer reads it for VK_EXT_memory_budget and keeps the compute duty cycle there, shared by every process of the
 * allocation. Only the allocation's own processes map it: whatever they write harms no one else, and the daemon
 * reads back only waited_ns, clamped, for /metrics. */
#define LEDGER_SHARED_MAGIC "GPPTLD01"
#define LEDGER_SHARED_SIZE 20480

struct ledger_shared_slice {
    _Atomic int64_t not_before_ns;            /* the layer's: no batch is submitted before this CLOCK_MONOTONIC time */
    _Atomic int64_t waited_ns;                /* the layer's: how long the slice's submits waited in all */
    _Atomic int64_t total;                    /* the daemon's: what the slice holds */
    _Atomic int64_t heap_usage[LEDGER_HEAPS]; /* the daemon's: of which on each heap */
    int64_t spare[13];                        /* to 256 bytes */
};

struct ledger_shared {
    char magic[8];
    uint32_t version;
    uint32_t slices;
    int64_t spare[6]; /* to 64 bytes */
    struct ledger_shared_slice slice[LEDGER_MAX_SLICES];
};

_Static_assert(sizeof(struct ledger_request) == 40, "src/gpuppetti/layer/ledger.py packs requests of 40 bytes");
_Static_assert(sizeof(struct ledger_answer) == 16, "and answers of 16");
_Static_assert(sizeof(struct ledger_slice_terms) == 16, "and slice terms of 16");
_Static_assert(sizeof(struct ledger_shared_slice) == 256, "the daemon writes each slice's figures 256 bytes apart");
_Static_assert(offsetof(struct ledger_shared, slice) == 64, "from offset 64");
_Static_assert(offsetof(struct ledger_shared_slice, waited_ns) == 8, "the daemon reads waited_ns here");
_Static_assert(offsetof(struct ledger_shared_slice, total) == 16, "and writes total here");
_Static_assert(offsetof(struct ledger_shared_slice, heap_usage) == 24, "and each heap's usage from here");
_Static_assert(sizeof(struct ledger_shared) <= LEDGER_SHARED_SIZE, "the shared page fits its memfd");

#endif
