#define _GNU_SOURCE
#include "accounting.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static bool lock_byte(int fd, int slot, short type)
{
    struct flock lock;
    memset(&lock, 0, sizeof lock);
    lock.l_type = type;
    lock.l_whence = SEEK_SET;
    lock.l_start = ACCT_LOCK_BASE + slot;
    lock.l_len = 1;
    /* Open-file-description locks: per open(), released on the last close, so by the kernel when a process dies. */
    return fcntl(fd, F_OFD_SETLK, &lock) == 0;
}

/* Give back what a dead process held in a slot; the exchange makes sure it is given back once. */
static int64_t empty_slot(struct acct_file *file, int slot)
{
    int64_t bytes = atomic_exchange(&file->slot_bytes[slot], 0);
    if (bytes != 0) {
        atomic_fetch_sub(&file->total, bytes);
    }
    for (int heap = 0; heap < ACCT_HEAPS; heap++) {
        int64_t part = atomic_exchange(&file->slot_heap[slot][heap], 0);
        if (part != 0) {
            atomic_fetch_sub(&file->heap_usage[heap], part);
        }
    }
    return bytes;
}

/* A slot whose write lock this description took is its own: held as a read lock from now on, so that a process that
 * finds no free slot can share it (accounting.h). The conversion is atomic: no one empties it in between. */
static bool keep_slot(int fd, int slot)
{
    return lock_byte(fd, slot, F_RDLCK);
}

static void claim_slot(struct acct *acct)
{
    acct->pid = (int)getpid();
    for (int slot = 0; slot < ACCT_SLOTS; slot++) {
        if (lock_byte(acct->fd, slot, F_WRLCK)) {
            /* Free: whoever had it is gone, and what it held comes back now. */
            empty_slot(acct->file, slot);
            if (keep_slot(acct->fd, slot)) {
                acct->slot = slot;
                return;
            }
            lock_byte(acct->fd, slot, F_UNLCK);
        }
    }
    /* Every slot is held by a live process: share one, read-locked like its owner's, so that it is emptied only when
     * every process counting in it is gone. Spread over the slots by pid. */
    for (int tried = 0; tried < ACCT_SLOTS; tried++) {
        int slot = (int)(((unsigned)acct->pid + (unsigned)tried) % ACCT_SLOTS);
        if (keep_slot(acct->fd, slot)) {
            acct->slot = slot;
            return;
        }
    }
    /* Each slot was being emptied at that very moment: count as unowned, never reaped (more, never less). */
    acct->slot = ACCT_NO_SLOT;
}

/* The file's first fields, as struct acct_file begins: read without the whole layout on the caller's stack. */
struct acct_header {
    char magic[8];
    uint32_t version;
    uint32_t slots;
};

_Static_assert(offsetof(struct acct_file, budget) == sizeof(struct acct_header), "the header is the file's start");

static bool usable(int fd)
{
    struct acct_header header;
    if (pread(fd, &header, sizeof header, 0) != (ssize_t)sizeof header) {
        return false;
    }
    off_t size = lseek(fd, 0, SEEK_END);
    return memcmp(header.magic, ACCT_MAGIC, sizeof header.magic) == 0 && header.version == ACCT_VERSION &&
           header.slots == ACCT_SLOTS && size >= (off_t)sizeof(struct acct_file);
}

/* Give back the memory of every slot whose owner has died. Returns how many slots held some. */
int acct_reap(struct acct *acct)
{
    if (!acct->shared) {
        return 0;
    }
    int freed = 0;
    for (int slot = 0; slot < ACCT_SLOTS; slot++) {
        if (slot == acct->slot || atomic_load(&acct->file->slot_bytes[slot]) == 0) {
            continue;
        }
        if (lock_byte(acct->fd, slot, F_WRLCK)) {
            freed += empty_slot(acct->file, slot) != 0;
            lock_byte(acct->fd, slot, F_UNLCK);
        }
    }
    return freed;
}

static _Atomic unsigned forks;
static atomic_flag fork_watched;

static void forked(void)
{
    atomic_fetch_add(&forks, 1);
}

unsigned acct_forks(void)
{
    return atomic_load_explicit(&forks, memory_order_relaxed);
}

void acct_open(struct acct *acct, const char *path, int64_t budget)
{
    if (!atomic_flag_test_and_set(&fork_watched)) {
        pthread_atfork(NULL, NULL, forked);
    }
    memset(acct, 0, sizeof *acct);
    acct->fd = -1;
    if (path != NULL) {
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0 && usable(fd)) {
            void *map = mmap(NULL, sizeof(struct acct_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (map != MAP_FAILED) {
                acct->file = map;
                acct->fd = fd;
                acct->shared = true;
                claim_slot(acct);
                /* What processes that died since held is free again: budgets read from now on say so. */
                acct_reap(acct);
                return;
            }
        }
        if (fd >= 0) {
            close(fd);
        }
    }
    /* No file to share: this process alone is held to the budget, in counts of this slice's own. */
    void *map = mmap(NULL, sizeof(struct acct_file), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        map = calloc(1, sizeof(struct acct_file));
    }
    acct->file = map;
    if (acct->file != NULL) {
        acct->file->budget = budget;
    }
    acct->slot = 0;
    acct->pid = (int)getpid();
}

/* A forked child shares its parent's open file description, and with it the slot's lock: it takes its own. */
static void own_slot(struct acct *acct)
{
    if (!acct->shared || acct->pid == (int)getpid()) {
        return;
    }
    /* Opening the file again through /proc gives a description, and so locks, of this process's own. */
    char path[64];
    int written = snprintf(path, sizeof path, "/proc/self/fd/%d", acct->fd);
    int fresh = written > 0 && written < (int)sizeof path ? open(path, O_RDWR | O_CLOEXEC) : -1;
    if (fresh < 0) {
        acct->pid = (int)getpid();
        /* Keep counting in the parent's slot: this process shares the description that holds its lock, so the
         * slot is emptied only once both are gone. */
        return;
    }
    close(acct->fd);
    acct->fd = fresh;
    claim_slot(acct);
}

bool acct_reserve(struct acct *acct, int64_t budget, uint32_t heap, int64_t size)
{
    if (heap >= ACCT_HEAPS || size < 0 || acct->file == NULL) {
        return false; /* no memory left to count in: nothing can be held to the budget */
    }
    own_slot(acct);
    struct acct_file *file = acct->file;
    for (int attempt = 0; attempt < 2; attempt++) {
        int64_t total = atomic_load(&file->total);
        while (total <= budget - size) {
            if (atomic_compare_exchange_weak(&file->total, &total, total + size)) {
                if (acct->slot == ACCT_NO_SLOT) {
                    atomic_fetch_add(&file->unowned, size);
                } else {
                    atomic_fetch_add(&file->slot_bytes[acct->slot], size);
                    atomic_fetch_add(&file->slot_heap[acct->slot][heap], size);
                }
                atomic_fetch_add(&file->heap_usage[heap], size);
                return true;
            }
        }
        if (acct_reap(acct) == 0) {
            break;
        }
    }
    return false;
}

void acct_release(struct acct *acct, uint32_t heap, int64_t size)
{
    if (heap >= ACCT_HEAPS || acct->file == NULL) {
        return;
    }
    struct acct_file *file = acct->file;
    atomic_fetch_sub(&file->heap_usage[heap], size);
    if (acct->slot == ACCT_NO_SLOT) {
        atomic_fetch_sub(&file->unowned, size);
    } else {
        atomic_fetch_sub(&file->slot_heap[acct->slot][heap], size);
        atomic_fetch_sub(&file->slot_bytes[acct->slot], size);
    }
    atomic_fetch_sub(&file->total, size);
}

void acct_export(struct acct *acct, uint32_t heap, int64_t size)
{
    if (heap >= ACCT_HEAPS || acct->file == NULL || acct->slot == ACCT_NO_SLOT) {
        return; /* unowned already */
    }
    struct acct_file *file = acct->file;
    /* Into unowned first: a reader never sees it in neither. */
    atomic_fetch_add(&file->unowned, size);
    atomic_fetch_sub(&file->slot_heap[acct->slot][heap], size);
    atomic_fetch_sub(&file->slot_bytes[acct->slot], size);
}

int64_t acct_total(const struct acct *acct)
{
    return acct->file != NULL ? atomic_load(&acct->file->total) : 0;
}

int64_t acct_heap_usage(const struct acct *acct, uint32_t heap)
{
    return heap < ACCT_HEAPS && acct->file != NULL ? atomic_load(&acct->file->heap_usage[heap]) : 0;
}
