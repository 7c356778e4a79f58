#define _GNU_SOURCE
#include "dutycycle.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

/* pthread_create, pthread_join and pthread_condattr_setclock moved into libc in glibc 2.34 under a new version. Bind
 * the first version of each, which glibc 2.34 and later still provide (in libc) and older ones do (in libpthread,
 * linked in as well), so the layer loads in containers with an older glibc too. */
#if defined(__x86_64__)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.2.5");
__asm__(".symver pthread_condattr_setclock,pthread_condattr_setclock@GLIBC_2.3.3");
#elif defined(__aarch64__)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.17");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.17");
__asm__(".symver pthread_condattr_setclock,pthread_condattr_setclock@GLIBC_2.17");
#endif

/* The most one batch is charged: a batch whose end was seen late (a process stopped with SIGSTOP) is not a debt
 * the slice ran up. A batch that really runs longer than this times the share gets more than its share. */
#define MAX_CHARGE_NS 10000000000LL
/* A time to wait for that lies further ahead than every batch in flight could have charged is not a debt but a
 * time from another boot (CLOCK_MONOTONIC starts again): it is forgotten. */
#define STALE_NS (2 * RING * MAX_CHARGE_NS)
/* The most of a wait that a process's batches in flight, not yet charged, may stand for: a submit waits while its
 * device's uncharged work is expected to take longer than this times the share. Without it, a client that queues
 * many batches without waiting holds the GPU for all of them and pays at its next submit. */
#define AHEAD_NS 100000000LL
/* The most of a late wake-up from a wait that is not held against the slice (the time between when its share let a
 * submit go and when the submit was made, the GPU idle meanwhile). */
#define CREDIT_NS 5000000LL

/* Batches in flight that are timed. A submit made while all are in flight waits until the oldest should have ended
 * (held_until); if it still has not, the submit goes untimed (a batch may wait on something the host signals only
 * after it submits more): the queue runs it before the next timed one, which is charged from the end of the timed one
 * before it, at most as long as its own time from its submit and the untimed ones' expected time. */
#define RING 64
#define QUEUES 16

struct record {
    VkQueue queue;
    VkFence fence;
    int64_t submitted;  /* when its submit began */
    int64_t released;   /* when the share let that submit go, where it had to wait for it (else 0) */
    int64_t first;      /* when the first submit it times began: itself, or an untimed one before it */
    int64_t expected;   /* the GPU time those submits were expected to take */
    int64_t before;     /* of which the untimed ones' */
    unsigned submits;   /* how many: itself and the untimed ones before it */
};

struct duty {
    VkDevice device;
    struct duty_calls calls;
    _Atomic(struct ledger_shared_slice *) *record;
    int permille;
    int64_t bound;           /* the most GPU time uncharged in flight: AHEAD_NS times the share */

    pthread_mutex_t lock;
    pthread_cond_t wake;     /* the thread: a batch to wait for */
    pthread_cond_t charged;  /* a submit held back by the work in flight: some of it was charged */
    struct record ring[RING];
    unsigned head, tail;     /* in flight: ring[head % RING] up to tail */
    VkFence spare[RING];
    int spare_count;
    VkFence fences[RING];    /* every fence made, to destroy */
    int fence_count;
    bool stop;
    pthread_t thread;
    /* What the submits in flight are expected to take: each as long as a submit took of late (a moving average;
     * a quarter of the bound until one was charged). */
    int64_t per_submit;
    int64_t expected;        /* every uncharged submit's, in all */
    int64_t untimed_expected;/* of which the submits since the last record, which have none */
    int64_t untimed_first;
    unsigned untimed;
    int64_t last_end;        /* when the last charged batch ended */

    /* The thread's own: where the last timed batch on each queue ended. */
    VkQueue queues[QUEUES];
    int64_t ended[QUEUES];
};

int64_t duty_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* a + b, held within int64 (a time from the shared page is the allocation's processes' to write). */
static int64_t add(int64_t a, int64_t b)
{
    if (b > 0 && a > INT64_MAX - b) {
        return INT64_MAX;
    }
    if (b < 0 && a < INT64_MIN - b) {
        return INT64_MIN;
    }
    return a + b;
}

static _Atomic int64_t *not_before(struct duty *duty)
{
    return &atomic_load(duty->record)->not_before_ns;
}

/* The slice may submit again once it has waited a batch's time over its share, from the batch's start (from base,
 * which may be earlier: a late wake-up's time is not held against it). */
static void push_out(struct duty *duty, int64_t base_start, int64_t took)
{
    if (took > MAX_CHARGE_NS) {
        took = MAX_CHARGE_NS;
    }
    int64_t cost = took * 1000 / duty->permille;
    _Atomic int64_t *shared = not_before(duty);
    int64_t current = atomic_load(shared);
    int64_t next;
    do {
        /* Time the slice did not use is not saved up: it starts from the batch's start at the latest. */
        int64_t base = current > base_start ? current : base_start;
        next = add(base, cost); /* the page is the allocation's processes' to write */
    } while (!atomic_compare_exchange_weak(shared, &current, next));
}

/* A batch (and the untimed ones before it) ran up to end: the slice may submit again once it has waited that long
 * over its share. Returns the time charged. */
static int64_t charge(struct duty *duty, const struct record *record, int64_t end)
{
    int64_t start = record->first;
    int index = -1;
    for (int i = 0; i < QUEUES; i++) {
        if (duty->queues[i] == record->queue || duty->queues[i] == VK_NULL_HANDLE) {
            index = i;
            break;
        }
    }
    if (index >= 0) {
        /* Work queued behind an earlier batch starts when that one ends. */
        if (duty->queues[index] == record->queue && duty->ended[index] > start) {
            start = duty->ended[index];
        }
        duty->queues[index] = record->queue;
        duty->ended[index] = end;
    }
    if (end <= start) {
        return 0;
    }
    int64_t took = end - start;
    if (record->submits > 1) {
        /* The untimed submits before it ran from start, but when they ended is not known: the queue may have
         * been idle between them and this one's submit. Their time is taken as expected, this one's as measured
         * from its submit, where that is less. */
        int64_t own_start = record->submitted > start ? record->submitted : start;
        int64_t own = end > own_start ? end - own_start : 0;
        if (add(own, record->before) < took) {
            took = add(own, record->before);
        }
    }
    /* A batch that went to an idle queue as soon as its wait ended: the time the submitting thread took to wake up
     * after its share let it go is not the slice's (the GPU was idle); up to CREDIT_NS of it. */
    int64_t base = start;
    if (record->submits == 1 && start == record->submitted && record->released > 0 && record->released < start) {
        base = start - record->released > CREDIT_NS ? start - CREDIT_NS : record->released;
    }
    push_out(duty, base, took);
    return took;
}

/* What a record's submits took: the estimate of the next ones follows it. Held: the lock. */
static void learn(struct duty *duty, const struct record *record, int64_t took, int64_t end)
{
    int64_t per = took / (int64_t)record->submits;
    if (per > MAX_CHARGE_NS) {
        per = MAX_CHARGE_NS;
    }
    duty->per_submit = duty->per_submit > 0 ? duty->per_submit + (per - duty->per_submit) / 4 : per;
    if (duty->per_submit < 1) {
        duty->per_submit = 1;
    }
    if (end > duty->last_end) {
        duty->last_end = end;
    }
}

/* Until when a submit waits for this process's work in flight (0: it need not). That work is expected to run from
 * when the oldest uncharged submit could start (its submit, or the last charged batch's end) for what each is
 * expected to take, and the submit waits until no more than the bound of it is left. Past RING records in flight it
 * also waits until the oldest should have ended, to be timed itself. Both are times, never events: a batch in flight
 * may wait for what the host does only after this submit, so the wait ends when the work should have run, charged or
 * not. Held: the lock. */
static int64_t held_until(const struct duty *duty)
{
    if (duty->expected <= 0) {
        return 0;
    }
    int64_t oldest = duty->untimed_expected;
    int64_t from = duty->untimed_first;
    if (duty->head != duty->tail) {
        oldest = duty->ring[duty->head % RING].expected;
        from = duty->ring[duty->head % RING].first;
    }
    if (duty->last_end > from) {
        from = duty->last_end;
    }
    int64_t until = add(from, duty->expected) - duty->bound;
    /* The oldest's end is seen a little late: it is given twice its expected time before a submit goes untimed. */
    int64_t oldest_due = add(from, add(oldest, oldest));
    if (duty->tail - duty->head >= RING && oldest_due > until) {
        until = oldest_due;
    }
    return until;
}

static void *wait_for_batches(void *argument)
{
    struct duty *duty = argument;
    pthread_mutex_lock(&duty->lock);
    for (;;) {
        while (duty->head == duty->tail && !duty->stop) {
            pthread_cond_wait(&duty->wake, &duty->lock);
        }
        if (duty->head == duty->tail) {
            break;
        }
        struct record record = duty->ring[duty->head % RING];
        pthread_mutex_unlock(&duty->lock);
        VkResult result = duty->calls.WaitForFences(duty->device, 1, &record.fence, VK_TRUE, UINT64_MAX);
        int64_t end = duty_now();
        int64_t took = 0;
        if (result == VK_SUCCESS) {
            took = charge(duty, &record, end);
            duty->calls.ResetFences(duty->device, 1, &record.fence);
        }
        pthread_mutex_lock(&duty->lock);
        if (result == VK_SUCCESS) {
            learn(duty, &record, took, end);
            duty->spare[duty->spare_count++] = record.fence;
        }
        duty->head++;
        /* With no record left in flight, only the untimed submits since the last are: no error is carried on. */
        duty->expected = duty->head == duty->tail ? duty->untimed_expected : duty->expected - record.expected;
        if (duty->expected < 0) {
            duty->expected = 0;
        }
        pthread_cond_broadcast(&duty->charged);
    }
    pthread_mutex_unlock(&duty->lock);
    return NULL;
}

struct duty *duty_create(VkDevice device, const struct duty_calls *calls,
                         _Atomic(struct ledger_shared_slice *) *record, int permille)
{
    if (permille <= 0 || permille >= 1000 || record == NULL || atomic_load(record) == NULL ||
        calls->QueueSubmit == NULL ||
        calls->CreateFence == NULL || calls->DestroyFence == NULL || calls->WaitForFences == NULL ||
        calls->ResetFences == NULL) {
        return NULL;
    }
    struct duty *duty = calloc(1, sizeof *duty);
    if (duty == NULL) {
        return NULL;
    }
    duty->device = device;
    duty->calls = *calls;
    duty->record = record;
    duty->permille = permille;
    duty->bound = AHEAD_NS * permille / 1000;
    pthread_mutex_init(&duty->lock, NULL);
    pthread_cond_init(&duty->wake, NULL);
    /* Timed waits on it are on CLOCK_MONOTONIC, which no one sets. */
    pthread_condattr_t monotonic;
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_cond_init(&duty->charged, &monotonic);
    pthread_condattr_destroy(&monotonic);
    if (pthread_create(&duty->thread, NULL, wait_for_batches, duty) != 0) {
        pthread_cond_destroy(&duty->charged);
        pthread_cond_destroy(&duty->wake);
        pthread_mutex_destroy(&duty->lock);
        free(duty);
        return NULL;
    }
    return duty;
}

static struct timespec at(int64_t ns)
{
    return (struct timespec){.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
}

int64_t duty_wait(struct duty *duty)
{
    int64_t released = 0;
    for (;;) {
        int64_t now = duty_now();
        int64_t until = atomic_load(not_before(duty));
        if (until > now) {
            int64_t wait = until - now;
            if (wait > STALE_NS) {
                atomic_compare_exchange_strong(not_before(duty), &until, now);
                continue;
            }
            /* In steps of at most a second: another process of the slice may move the time while this one
             * sleeps. */
            if (wait > 1000000000) {
                wait = 1000000000;
            }
            struct timespec pause = at(wait);
            int64_t began = duty_now();
            while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
            }
            atomic_fetch_add(&atomic_load(duty->record)->waited_ns, duty_now() - began);
            released = until;
            continue;
        }
        /* The slice may submit, unless its work in flight here, once charged, would already have it wait longer
         * than AHEAD_NS: then until enough of it should have run (or some of it was charged). */
        pthread_mutex_lock(&duty->lock);
        int64_t held = held_until(duty);
        if (held <= now) {
            pthread_mutex_unlock(&duty->lock);
            return released;
        }
        struct timespec deadline = at(held - now > 1000000000 ? now + 1000000000 : held);
        int64_t began = duty_now();
        pthread_cond_timedwait(&duty->charged, &duty->lock, &deadline);
        pthread_mutex_unlock(&duty->lock);
        atomic_fetch_add(&atomic_load(duty->record)->waited_ns, duty_now() - began);
        released = 0;
    }
}

/* A submit that is not timed: it counts in what is expected of the next record. Held: the lock. */
static void untimed(struct duty *duty, int64_t submitted, int64_t expected)
{
    if (duty->untimed++ == 0) {
        duty->untimed_first = submitted;
    }
    duty->untimed_expected = add(duty->untimed_expected, expected);
}

void duty_track(struct duty *duty, VkQueue queue, int64_t submitted, int64_t released)
{
    VkFence fence = VK_NULL_HANDLE;
    pthread_mutex_lock(&duty->lock);
    int64_t expected = duty->per_submit > 0 ? duty->per_submit : duty->bound / 4 + 1;
    duty->expected = add(duty->expected, expected);
    bool room = duty->tail - duty->head < RING;
    if (room && duty->spare_count > 0) {
        fence = duty->spare[--duty->spare_count];
    } else if (room && duty->fence_count < RING) {
        VkFenceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
        if (duty->calls.CreateFence(duty->device, &info, NULL, &fence) == VK_SUCCESS) {
            duty->fences[duty->fence_count++] = fence;
        } else {
            fence = VK_NULL_HANDLE;
        }
    }
    if (fence == VK_NULL_HANDLE) {
        untimed(duty, submitted, expected);
        pthread_mutex_unlock(&duty->lock);
        return;
    }
    pthread_mutex_unlock(&duty->lock);
    /* An empty submit with a fence: it signals when everything submitted to the queue before it is done. */
    if (duty->calls.QueueSubmit(queue, 0, NULL, fence) != VK_SUCCESS) {
        pthread_mutex_lock(&duty->lock);
        duty->spare[duty->spare_count++] = fence;
        untimed(duty, submitted, expected);
        pthread_mutex_unlock(&duty->lock);
        return;
    }
    pthread_mutex_lock(&duty->lock);
    duty->ring[duty->tail % RING] = (struct record){
        .queue = queue, .fence = fence, .submitted = submitted, .released = released,
        .first = duty->untimed > 0 ? duty->untimed_first : submitted,
        .expected = add(duty->untimed_expected, expected), .before = duty->untimed_expected,
        .submits = duty->untimed + 1};
    duty->untimed = 0;
    duty->untimed_expected = 0;
    duty->tail++;
    pthread_cond_signal(&duty->wake);
    pthread_mutex_unlock(&duty->lock);
}

void duty_destroy(struct duty *duty)
{
    if (duty == NULL) {
        return;
    }
    pthread_mutex_lock(&duty->lock);
    duty->stop = true;
    pthread_cond_signal(&duty->wake);
    pthread_mutex_unlock(&duty->lock);
    pthread_join(duty->thread, NULL);
    for (int i = 0; i < duty->fence_count; i++) {
        duty->calls.DestroyFence(duty->device, duty->fences[i], NULL);
    }
    pthread_cond_destroy(&duty->charged);
    pthread_cond_destroy(&duty->wake);
    pthread_mutex_destroy(&duty->lock);
    free(duty);
}
