/* The memory a slice has handed out, shared by every process of a container and by every container of one DRA
 * claim: one file per slice, in a per-allocation directory the daemon creates and mounts read-write.
 *
 * The file is mapped shared and updated with atomics. A reservation is a compare-and-swap on the total that never
 * lets it pass the budget. Each process also counts its own part in a slot it owns for as long as it lives: it holds
 * an open-file-description lock on that slot's byte, which the kernel releases when the process dies, however it
 * dies and whatever PID namespace it runs in. A process that finds the budget spent looks for slots whose lock is
 * free and gives their memory back before it refuses.
 *
 * gpuppetti's daemons create the file (src/gpuppetti/node/vulkanlayer.py writes the same layout). The container can write
 * it too: nothing read from it is trusted to be in range (arithmetic on it saturates or wraps, never overflows).
 */
#ifndef GPUPPETTI_ACCOUNTING_H
#define GPUPPETTI_ACCOUNTING_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ACCT_MAGIC "GPPTVK01"
#define ACCT_VERSION 1
#define ACCT_SLOTS 256
#define ACCT_HEAPS 16
/* The lock bytes lie past the data, so that locking never touches what is mapped. */
#define ACCT_LOCK_BASE 1048576
#define ACCT_FILE_SIZE 36864

struct acct_file {
    char magic[8];
    uint32_t version;
    uint32_t slots;
    int64_t budget;
    _Atomic int64_t total;
    _Atomic int64_t heap_usage[ACCT_HEAPS];
    _Atomic int64_t slot_bytes[ACCT_SLOTS];
    _Atomic int64_t slot_heap[ACCT_SLOTS][ACCT_HEAPS];
    /* The compute duty cycle (dutycycle.h): no batch is submitted before this CLOCK_MONOTONIC time, in ns. Zero
     * in a new file, and within ACCT_FILE_SIZE, so files written before it existed hold it too. */
    _Atomic int64_t not_before_ns;
    /* How long the slice's submits have waited in all, in ns: what /metrics reports as compute wait. */
    _Atomic int64_t waited_ns;
    /* Bytes counted in total that no slot holds (exported memory, and a process's that found no slot): never
     * reaped. Zero in files written before it existed, as it should be. */
    _Atomic int64_t unowned;
};

_Static_assert(sizeof(struct acct_file) <= ACCT_FILE_SIZE, "the accounting layout outgrew its file");
/* src/gpuppetti/node/vulkanlayer.py clears it there when it keeps a file across a restart (or a reboot). */
_Static_assert(offsetof(struct acct_file, not_before_ns) == 34976, "the daemons know not_before_ns's offset");
/* src/gpuppetti/node/vulkanlayer.py reads it for /metrics. */
_Static_assert(offsetof(struct acct_file, waited_ns) == 34984, "the daemons know waited_ns's offset");
/* src/gpuppetti/node/vulkanlayer.py reads slot_bytes and unowned for /metrics. */
_Static_assert(offsetof(struct acct_file, slot_bytes) == 160, "the daemons know slot_bytes's offset");
_Static_assert(offsetof(struct acct_file, unowned) == 34992, "the daemons know unowned's offset");

struct acct {
    struct acct_file *file; /* the shared mapping; a private one where no file could be used; NULL: no memory */
    int fd;                 /* -1 for a private mapping */
    int slot;               /* ACCT_NO_SLOT: counted as unowned */
    int pid;                /* the process that claimed the slot: a forked child claims its own */
    bool shared;
};

#define ACCT_NO_SLOT (-1)

/* Open (or, with no usable file, make a private) accounting for one slice. Never fails: a slice whose file cannot be
 * used still enforces its budget within the process. */
void acct_open(struct acct *acct, const char *path, int64_t budget);
/* Reserve size bytes of heap; false when the slice's budget would be passed. */
bool acct_reserve(struct acct *acct, int64_t budget, uint32_t heap, int64_t size);
void acct_release(struct acct *acct, uint32_t heap, int64_t size);
/* Size bytes of this process's were exported: they stay counted whoever holds them, and are never reaped. */
void acct_export(struct acct *acct, uint32_t heap, int64_t size);
/* How many forks lie between this process and the one that loaded the layer: memory tracked under another count was
 * allocated by an ancestor, whose it stays. */
unsigned acct_forks(void);
/* Give back what every dead process of the slice held (a process SIGKILLed with memory allocated); how many slots
 * held some. */
int acct_reap(struct acct *acct);
int64_t acct_total(const struct acct *acct);
int64_t acct_heap_usage(const struct acct *acct, uint32_t heap);

#endif
