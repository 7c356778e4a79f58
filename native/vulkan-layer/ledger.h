/* The process's connection to its allocation's ledger, kept by the daemon (ledger_protocol.h says how they speak).
 *
 *   GPUPPETTI_VK_LEDGER          the ledger's Unix socket, in a directory the container mounts read-only
 *   GPUPPETTI_VK_LEDGER_WAIT_MS  how long a reservation waits for the daemon while it is away (default 15000)
 *
 * The connection is made at the first vkCreateDevice of a device whose slice has a budget or a compute share, and
 * says HELLO: the daemon answers with each slice's terms and the allocation's shared page, where it writes what each
 * slice holds and where the slice's compute duty cycle is kept by every process of the allocation. A reservation
 * (vkAllocateMemory) asks the daemon, which refuses what would pass the slice's budget; what this process frees is
 * kept as spare, up to LEDGER_SPARE_MAX per slice, for its next reservations without a round trip, and the rest is
 * given back. What the connection holds is given back by the daemon when it closes, however the process ends.
 *
 * Exported memory (vkGetMemoryFdKHR) is charged once, to the object (the exported file's st_dev and st_ino), for as
 * long as some process of the allocation holds it: the exporter until it frees it, each importer until it frees its
 * handle.
 *
 * The daemon away (restarted, upgraded): a reservation tries again every 20 ms, for at most
 * GPUPPETTI_VK_LEDGER_WAIT_MS, then is refused; a free counts in this process alone. A thread of the layer's watches
 * the connection and connects again as soon as the daemon is back: the process then declares what it holds, so that
 * the new daemon's ledger knows it before it hands memory out. Submits never wait for the daemon.
 *
 * Without GPUPPETTI_VK_LEDGER, or with a daemon that answers what the layer does not understand, a private page
 * stands in: the process alone is held to the budgets of GPUPPETTI_VK_SLICES.
 *
 * A forked child has a connection of its own, made when it first needs one: it holds nothing of its parent's.
 *
 * Everything read from the daemon or the shared page (which every process of the allocation may write) is held in
 * range before it is used: no arithmetic on it overflows.
 */
#ifndef GPUPPETTI_LEDGER_H
#define GPUPPETTI_LEDGER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ledger_protocol.h"

/* The most a process keeps of what it freed on one slice, unreturned, for its next reservations. */
#define LEDGER_SPARE_MAX (1 << 20)

struct slices;

/* An exported object: the st_dev and st_ino of its file descriptor, the same in every process that holds one. */
struct ledger_key {
    uint64_t dev;
    uint64_t ino;
};

/* The terms of HELLO's answer, checked. */
struct ledger_terms {
    int count;
    int64_t budget[LEDGER_MAX_SLICES]; /* >= 0; 0: not limited */
    int compute[LEDGER_MAX_SLICES];    /* 1 to 1000; 0: the daemon does not know it (the environment says) */
};

/* Set up from the environment for these slices (slices_get calls it once, before anything else): numbers each slice
 * (its index). Connects to nothing yet. */
void ledger_setup(struct slices *slices);
/* Connect, where no connection was tried yet; never waits for an absent daemon. */
void ledger_open(void);
/* A slice's compute share and budget: the daemon's where it said them, else the environment's. */
int ledger_compute(int slice, int fallback);
int64_t ledger_budget(int slice, int64_t fallback);
/* Reserve size bytes of the slice's heap; false when the slice's budget would be passed, or when the daemon stayed
 * away for GPUPPETTI_VK_LEDGER_WAIT_MS. */
bool ledger_reserve(int slice, uint32_t heap, int64_t size);
void ledger_release(int slice, uint32_t heap, int64_t size);
/* The object an exported (or imported) file descriptor stands for; false where fd is none. */
bool ledger_key_of(int fd, struct ledger_key *key);
/* Size bytes reserved on the slice's heap were exported as the object key: charged to it from now on, and held by
 * this process until ledger_unhold. False where it stays a reservation (given back by ledger_release): no memory
 * was left to remember the object by, or this process holds it already. */
bool ledger_export(int slice, uint32_t heap, int64_t size, struct ledger_key key);
/* The object key was imported: true where it is counted (the allocation's own), and it is then held by this process
 * until ledger_unhold; false where it is someone else's memory (or the daemon stayed away for
 * GPUPPETTI_VK_LEDGER_WAIT_MS: the import is then not counted). */
bool ledger_hold(int slice, uint32_t heap, int64_t size, struct ledger_key key);
void ledger_unhold(struct ledger_key key);
/* How many forks lie between this process and the one that loaded the layer: memory tracked under another count was
 * allocated by an ancestor, whose it stays. */
unsigned ledger_forks(void);
/* Where the slice's shared record lies: the daemon's page, or the private one. The pointer is swapped at a reconnect
 * (a record once pointed to stays mapped); whoever reads through it reads it again each time. */
_Atomic(struct ledger_shared_slice *) *ledger_record(int slice);
/* Until the daemon has taken what this process told it without an answer (frees): the page then shows them. Never
 * waits for an absent daemon. */
void ledger_sync(int slice);
/* What the slice holds, in all and on a heap, as the daemon last wrote it (or this process counts it alone): >= 0. */
int64_t ledger_total(int slice);
int64_t ledger_heap_usage(int slice, uint32_t heap);
/* What this process keeps as spare on the slice's heap (LEDGER_HEAPS: on all of them): counted in the ledger's
 * figures, yet this process's to use. */
int64_t ledger_spare(int slice, uint32_t heap);

/* HELLO's answer (a struct ledger_answer, then its terms: length bytes in all) and the shared page it handed over
 * (page_size bytes from page): whether they are what a process of `slices` slices can use, and their terms. */
bool ledger_parse_hello(const void *answer, size_t length, const void *page, int64_t page_size, int slices,
                        struct ledger_terms *out);

#endif
