#define _GNU_SOURCE
#include "ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "slices.h"

/* As in dutycycle.c: the first versions of the thread functions, so that the layer loads with an older glibc too. */
#if defined(__x86_64__)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.17");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.17");
#endif

/* How long a daemon has to answer a request (or to take one) before the connection counts as lost: longer than a
 * restarted daemon holds reservations back while the processes of before declare what they hold. */
#define ANSWER_MS 5000
/* How often a reservation, and the watcher, try again while the daemon is away; the watcher more slowly once it has
 * been away for GPUPPETTI_VK_LEDGER_WAIT_MS. */
#define RETRY_NS 20000000LL
#define SLOW_RETRY_MS 250
#define DEFAULT_WAIT_MS 15000
/* File descriptors a HELLO's answer may carry beside the page's (each closed at once). */
#define MAX_FDS 8

enum mode {
    IDLE,      /* not connected: the next reservation connects */
    CONNECTED,
    PRIVATE,   /* no ledger: this process alone is held to its budgets, on the private page */
};

/* An exported object this process holds (it exported or imported it): charged to the object, once. */
struct object {
    struct object *next;
    struct ledger_key key;
    int slice;
    uint32_t heap;
    int64_t size;
    unsigned refs; /* this process's handles to it: the ledger is told when the last is freed */
};

struct slice_state {
    _Atomic(struct ledger_shared_slice *) record;
    int64_t budget; /* the daemon's where it said it, else the environment's */
    int compute;    /* the daemon's; 0: it did not say */
    int64_t held[LEDGER_HEAPS];  /* reserved by this process's live allocations (not exported) */
    int64_t spare[LEDGER_HEAPS]; /* freed, and held on the connection for the next reservations */
};

static struct {
    pthread_mutex_t lock; /* everything below, and the socket: one round trip or send at a time */
    enum mode mode;
    bool tried;           /* ledger_open connected once (or tried to) */
    bool unanswered;      /* one-way requests went since the last answer: the page may not show them yet */
    unsigned generation;  /* of the connection: each connect and disconnect makes a new one */
    int fd;
    int count;
    struct slice_state *slices;
    struct ledger_shared *private_page; /* this process's own counts, and a duty cycle of its own */
    struct object *objects;
    struct sockaddr_un address;
    int64_t wait_ns;
} ledger = {.lock = PTHREAD_MUTEX_INITIALIZER, .mode = PRIVATE, .fd = -1};

/* The watcher: a thread that sees the connection close (the daemon stopped) and connects again as soon as the daemon
 * is back, so that the new daemon learns what this process holds before it hands memory out (it holds reservations
 * back for a moment after a restart for that), not at this process's next allocation. Under the ledger's lock. */
static struct {
    bool running;
    bool stop;
    pthread_t thread;
    int wake; /* an eventfd: the layer is being unloaded */
} watcher = {.wake = -1};

static _Atomic unsigned forks;
static atomic_flag said_private, said_wait;

static void say_once(atomic_flag *said, const char *what, const char *detail)
{
    if (!atomic_flag_test_and_set(said)) {
        fprintf(stderr, "gpuppetti Vulkan layer: %s%s\n", what, detail);
    }
}

static int64_t now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static int64_t clamped(int64_t value)
{
    return value < 0 ? 0 : value;
}

/* a + b for figures that are each >= 0: held at INT64_MAX. */
static int64_t sum(int64_t a, int64_t b)
{
    return a > INT64_MAX - b ? INT64_MAX : a + b;
}

/* fstat itself is a symbol of glibc 2.33 (a wrapper before): the system call, for the layer to load with glibc 2.17.
 * On x86_64 and aarch64 the kernel's struct stat is glibc's. */
static int stat_of(int fd, struct stat *info)
{
    return (int)syscall(SYS_fstat, fd, info);
}

bool ledger_key_of(int fd, struct ledger_key *key)
{
    struct stat info;
    if (fd < 0 || stat_of(fd, &info) != 0) {
        return false;
    }
    *key = (struct ledger_key){(uint64_t)info.st_dev, (uint64_t)info.st_ino};
    return true;
}

/* -- HELLO's answer ------------------------------------------------------------------------------------------ */

bool ledger_parse_hello(const void *answer_bytes, size_t length, const void *page, int64_t page_size, int slices,
                        struct ledger_terms *out)
{
    memset(out, 0, sizeof *out);
    struct ledger_answer answer;
    if (length < sizeof answer || slices < 1 || slices > LEDGER_MAX_SLICES) {
        return false;
    }
    memcpy(&answer, answer_bytes, sizeof answer);
    if (answer.status != LEDGER_OK || answer.count != (uint32_t)slices || answer.value < LEDGER_SHARED_SIZE ||
        length != sizeof answer + (size_t)slices * sizeof(struct ledger_slice_terms)) {
        return false;
    }
    if (page == NULL || page_size < LEDGER_SHARED_SIZE) {
        return false;
    }
    struct {
        char magic[8];
        uint32_t version;
        uint32_t slices;
    } header;
    memcpy(&header, page, sizeof header);
    if (memcmp(header.magic, LEDGER_SHARED_MAGIC, sizeof header.magic) != 0 || header.version != LEDGER_VERSION ||
        header.slices != (uint32_t)slices) {
        return false;
    }
    out->count = slices;
    const unsigned char *terms = (const unsigned char *)answer_bytes + sizeof answer;
    for (int i = 0; i < slices; i++) {
        struct ledger_slice_terms term;
        memcpy(&term, terms + (size_t)i * sizeof term, sizeof term);
        out->budget[i] = clamped(term.budget);
        out->compute[i] = term.compute <= 0 ? 0 : term.compute > 1000 ? 1000 : (int)term.compute;
    }
    return true;
}

/* -- the socket ---------------------------------------------------------------------------------------------- */

static bool send_all(int fd, const void *data, size_t size)
{
    const char *cursor = data;
    while (size > 0) {
        ssize_t sent = send(fd, cursor, size, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR) {
            continue;
        }
        if (sent <= 0) {
            return false;
        }
        cursor += sent;
        size -= (size_t)sent;
    }
    return true;
}

/* Read size bytes; file descriptors that come beside them are kept in *passed (the first) or closed. */
static bool receive_all(int fd, void *data, size_t size, int *passed)
{
    char *cursor = data;
    while (size > 0) {
        union {
            char buffer[CMSG_SPACE(sizeof(int) * MAX_FDS)];
            struct cmsghdr align;
        } control;
        struct iovec part = {.iov_base = cursor, .iov_len = size};
        struct msghdr message = {.msg_iov = &part, .msg_iovlen = 1, .msg_control = control.buffer,
                                 .msg_controllen = sizeof control.buffer};
        ssize_t got = recvmsg(fd, &message, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        for (struct cmsghdr *header = got >= 0 ? CMSG_FIRSTHDR(&message) : NULL; header != NULL;
             header = CMSG_NXTHDR(&message, header)) {
            if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) {
                continue;
            }
            size_t fds = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < fds; i++) {
                int one;
                memcpy(&one, CMSG_DATA(header) + i * sizeof(int), sizeof one);
                if (passed != NULL && *passed < 0) {
                    *passed = one;
                } else {
                    close(one);
                }
            }
        }
        if (got <= 0) {
            return false;
        }
        cursor += got;
        size -= (size_t)got;
    }
    return true;
}

static struct ledger_request request(uint32_t op, int slice, uint32_t heap, int64_t size, struct ledger_key key)
{
    return (struct ledger_request){.op = op, .slice = (uint32_t)slice, .heap = heap, .size = (uint64_t)size,
                                   .key_dev = key.dev, .key_ino = key.ino};
}

/* The connection lost (or never made): what it held, the daemon gave back; the spare with it. Held: the lock. */
static void disconnect(void)
{
    ledger.generation++;
    if (ledger.fd >= 0) {
        close(ledger.fd);
        ledger.fd = -1;
    }
    if (ledger.mode == CONNECTED) {
        ledger.mode = IDLE;
    }
    for (int i = 0; i < ledger.count; i++) {
        memset(ledger.slices[i].spare, 0, sizeof ledger.slices[i].spare);
    }
}

/* A one-way request. Held: the lock. */
static void tell(struct ledger_request message)
{
    if (ledger.mode == CONNECTED && !send_all(ledger.fd, &message, sizeof message)) {
        disconnect();
    }
    ledger.unanswered = true;
}

/* A request and its answer; false where the connection was lost. Held: the lock. */
static bool ask(struct ledger_request message, struct ledger_answer *answer)
{
    if (ledger.mode != CONNECTED) {
        return false;
    }
    if (!send_all(ledger.fd, &message, sizeof message) || !receive_all(ledger.fd, answer, sizeof *answer, NULL)) {
        disconnect();
        return false;
    }
    /* The daemon takes a connection's requests in order: those before this one are on the page now. */
    ledger.unanswered = false;
    return true;
}

/* No ledger to use: this process alone is held to its budgets from now on. Held: the lock. */
static void go_private(const char *why)
{
    disconnect();
    ledger.mode = PRIVATE;
    for (int i = 0; i < ledger.count; i++) {
        struct slice_state *state = &ledger.slices[i];
        /* The private page holds this process's own counts, and its own duty cycle from now on. */
        struct ledger_shared_slice *record = &ledger.private_page->slice[i];
        struct ledger_shared_slice *old = atomic_load(&state->record);
        if (old != record) {
            atomic_store(&record->not_before_ns, atomic_load(&old->not_before_ns));
            atomic_store(&state->record, record);
        }
    }
    say_once(&said_private, why, "; this process alone is held to its slices' budgets");
}

/* The new page's duty cycle takes over the old one's: no submit goes earlier than either allowed. */
static void take_over(struct ledger_shared_slice *fresh, struct ledger_shared_slice *old)
{
    int64_t until = atomic_load(&old->not_before_ns);
    int64_t theirs = atomic_load(&fresh->not_before_ns);
    while (theirs < until && !atomic_compare_exchange_weak(&fresh->not_before_ns, &theirs, until)) {
    }
}

static void connect_ledger(void);

static void *watch(void *unused)
{
    (void)unused;
    int64_t away_since = 0;
    pthread_mutex_lock(&ledger.lock);
    while (!watcher.stop) {
        if (ledger.mode == IDLE) {
            connect_ledger();
        }
        int fd = ledger.mode == CONNECTED ? ledger.fd : -1;
        unsigned generation = ledger.generation;
        int timeout = 1000;
        if (ledger.mode == PRIVATE) {
            /* Nothing more to watch: until the layer is unloaded (it joins this thread then). */
            timeout = -1;
        } else if (fd >= 0) {
            away_since = 0;
        } else {
            away_since = away_since != 0 ? away_since : now_ns();
            timeout = now_ns() - away_since < ledger.wait_ns ? (int)(RETRY_NS / 1000000) : SLOW_RETRY_MS;
        }
        pthread_mutex_unlock(&ledger.lock);
        /* Answers are read by whoever asked: only a hang-up is watched for here. */
        struct pollfd polled[2] = {{.fd = watcher.wake, .events = POLLIN}, {.fd = fd, .events = POLLRDHUP}};
        int ready = poll(polled, 2, timeout);
        pthread_mutex_lock(&ledger.lock);
        bool hung_up = ready > 0 && fd >= 0 && (polled[1].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
        if (hung_up && ledger.generation == generation && ledger.mode == CONNECTED) {
            disconnect();
        }
    }
    pthread_mutex_unlock(&ledger.lock);
    return NULL;
}

/* Held: the lock. */
static void start_watcher(void)
{
    if (watcher.running || watcher.stop) {
        return;
    }
    if (watcher.wake < 0) {
        watcher.wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    }
    if (watcher.wake < 0 || pthread_create(&watcher.thread, NULL, watch, NULL) != 0) {
        return; /* no watcher: the process reconnects at its next reservation instead */
    }
    watcher.running = true;
}

/* When the layer is unloaded (the loader unloads it with the last instance) or the process exits: the watcher stops
 * before its code goes, and the connection closes (what it held is given back: nothing but spare is left by then,
 * every device having freed its memory). */
__attribute__((destructor)) static void unload(void)
{
    pthread_mutex_lock(&ledger.lock);
    bool running = watcher.running;
    pthread_t thread = watcher.thread;
    watcher.stop = true;
    pthread_mutex_unlock(&ledger.lock);
    if (running) {
        uint64_t one = 1;
        if (write(watcher.wake, &one, sizeof one) == (ssize_t)sizeof one) {
            pthread_join(thread, NULL);
        }
    }
    pthread_mutex_lock(&ledger.lock);
    disconnect();
    pthread_mutex_unlock(&ledger.lock);
}

/* Connect, say HELLO, declare what this process holds, and use the new page. Held: the lock. */
static void connect_ledger(void)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return;
    }
    /* A daemon that takes neither requests nor answers for this long counts as away. */
    struct timeval timeout = {.tv_sec = ANSWER_MS / 1000, .tv_usec = (ANSWER_MS % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    if (connect(fd, (const struct sockaddr *)&ledger.address, sizeof ledger.address) != 0) {
        close(fd);
        return;
    }
    struct ledger_request hello = {.op = LEDGER_HELLO, .size = LEDGER_VERSION};
    unsigned char answer[sizeof(struct ledger_answer) + LEDGER_MAX_SLICES * sizeof(struct ledger_slice_terms)];
    int page_fd = -1;
    if (!send_all(fd, &hello, sizeof hello) || !receive_all(fd, answer, sizeof(struct ledger_answer), &page_fd)) {
        if (page_fd >= 0) {
            close(page_fd);
        }
        close(fd);
        return;
    }
    struct ledger_answer head;
    memcpy(&head, answer, sizeof head);
    size_t length = sizeof head;
    if (head.count == (uint32_t)ledger.count) {
        size_t terms = (size_t)ledger.count * sizeof(struct ledger_slice_terms);
        if (!receive_all(fd, answer + length, terms, &page_fd)) {
            if (page_fd >= 0) {
                close(page_fd);
            }
            close(fd);
            return;
        }
        length += terms;
    }
    struct stat info;
    void *page = MAP_FAILED;
    int64_t page_size = 0;
    if (page_fd >= 0 && stat_of(page_fd, &info) == 0 && info.st_size >= LEDGER_SHARED_SIZE &&
        (fcntl(page_fd, F_GET_SEALS) & F_SEAL_SHRINK) != 0) {
        /* Sealed against shrinking: no process of the allocation can make a read of it fault. */
        page = mmap(NULL, LEDGER_SHARED_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, page_fd, 0);
        page_size = LEDGER_SHARED_SIZE;
    }
    if (page_fd >= 0) {
        close(page_fd);
    }
    struct ledger_terms terms;
    if (!ledger_parse_hello(answer, length, page != MAP_FAILED ? page : NULL, page_size, ledger.count, &terms)) {
        if (page != MAP_FAILED) {
            munmap(page, LEDGER_SHARED_SIZE);
        }
        close(fd);
        go_private("the ledger's answer is not one this layer understands");
        return;
    }
    /* What this process holds, declared to what may be a new daemon (the one before gave it back when the
     * connection closed): its allocations, then the objects it holds. */
    bool told = true;
    for (int i = 0; i < ledger.count && told; i++) {
        for (uint32_t heap = 0; heap < LEDGER_HEAPS && told; heap++) {
            if (ledger.slices[i].held[heap] > 0) {
                struct ledger_request declare =
                    request(LEDGER_DECLARE, i, heap, ledger.slices[i].held[heap], (struct ledger_key){0, 0});
                told = send_all(fd, &declare, sizeof declare);
            }
        }
    }
    for (struct object *object = ledger.objects; object != NULL && told; object = object->next) {
        struct ledger_request declare =
            request(LEDGER_DECLARE_HOLD, object->slice, object->heap, object->size, object->key);
        told = send_all(fd, &declare, sizeof declare);
    }
    if (!told) {
        munmap(page, LEDGER_SHARED_SIZE); /* never published: no one reads it */
        close(fd);
        return;
    }
    struct ledger_shared *shared = page;
    for (int i = 0; i < ledger.count; i++) {
        struct slice_state *state = &ledger.slices[i];
        struct ledger_shared_slice *fresh = &shared->slice[i];
        /* The old page stays mapped: another thread may be reading it now. */
        take_over(fresh, atomic_load(&state->record));
        atomic_store(&state->record, fresh);
        if (terms.budget[i] > 0 || state->budget <= 0) {
            state->budget = terms.budget[i];
        }
        state->compute = terms.compute[i];
        memset(state->spare, 0, sizeof state->spare);
    }
    ledger.fd = fd;
    ledger.mode = CONNECTED;
    ledger.generation++;
    start_watcher();
}

/* -- setting up, and forks ----------------------------------------------------------------------------------- */

static void forked(void)
{
    atomic_fetch_add(&forks, 1);
    /* The connection is the parent's: kept, it would keep the parent's memory charged after the parent died. The
     * child holds nothing, and connects on its own when it needs to. Another thread may have held the lock at the
     * fork: it is made anew. */
    pthread_mutex_init(&ledger.lock, NULL);
    if (ledger.fd >= 0) {
        close(ledger.fd);
        ledger.fd = -1;
    }
    if (ledger.mode == CONNECTED) {
        ledger.mode = IDLE;
    }
    ledger.tried = false;
    ledger.unanswered = false;
    /* The watcher is the parent's: the child starts its own when it connects. */
    watcher.running = false;
    if (watcher.wake >= 0) {
        close(watcher.wake);
        watcher.wake = -1;
    }
    /* Left allocated: another thread may have been changing the list at the fork. */
    ledger.objects = NULL;
    for (int i = 0; i < ledger.count; i++) {
        struct slice_state *state = &ledger.slices[i];
        memset(state->held, 0, sizeof state->held);
        memset(state->spare, 0, sizeof state->spare);
        struct ledger_shared_slice *own = &ledger.private_page->slice[i];
        atomic_store(&own->total, 0);
        for (int heap = 0; heap < LEDGER_HEAPS; heap++) {
            atomic_store(&own->heap_usage[heap], 0);
        }
    }
}

unsigned ledger_forks(void)
{
    return atomic_load_explicit(&forks, memory_order_relaxed);
}

static int64_t wait_from(const char *text)
{
    if (text == NULL) {
        return (int64_t)DEFAULT_WAIT_MS * 1000000;
    }
    char *end = NULL;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || value < 0 || value > 86400000) {
        if (!atomic_flag_test_and_set(&said_wait)) {
            fprintf(stderr, "gpuppetti Vulkan layer: GPUPPETTI_VK_LEDGER_WAIT_MS=%.40s does not parse; a reservation "
                    "waits up to %d ms for an absent ledger\n", text, DEFAULT_WAIT_MS);
        }
        return (int64_t)DEFAULT_WAIT_MS * 1000000;
    }
    return (int64_t)value * 1000000;
}

void ledger_setup(struct slices *slices)
{
    for (int i = 0; i < slices->count; i++) {
        slices->items[i].index = i;
    }
    ledger.private_page = calloc(1, sizeof *ledger.private_page);
    ledger.slices = calloc((size_t)slices->count, sizeof *ledger.slices);
    if (ledger.private_page == NULL || ledger.slices == NULL) {
        free(ledger.private_page);
        free(ledger.slices);
        ledger.private_page = NULL;
        ledger.slices = NULL;
        /* Nothing to count in: every reservation is refused (more, never less). */
        return;
    }
    pthread_atfork(NULL, NULL, forked);
    ledger.count = slices->count;
    for (int i = 0; i < slices->count; i++) {
        ledger.slices[i].budget = slices->items[i].budget;
        atomic_store(&ledger.slices[i].record, &ledger.private_page->slice[i]);
    }
    ledger.wait_ns = wait_from(getenv("GPUPPETTI_VK_LEDGER_WAIT_MS"));
    const char *path = getenv("GPUPPETTI_VK_LEDGER");
    ledger.address.sun_family = AF_UNIX;
    if (path == NULL || *path == '\0') {
        ledger.mode = PRIVATE;
    } else if (strlen(path) >= sizeof ledger.address.sun_path || slices->count > LEDGER_MAX_SLICES) {
        ledger.mode = PRIVATE;
        say_once(&said_private, "GPUPPETTI_VK_LEDGER is too long, or there are too many slices for a ledger",
                 "; this process alone is held to its slices' budgets");
    } else {
        memcpy(ledger.address.sun_path, path, strlen(path) + 1);
        ledger.mode = IDLE;
    }
}

void ledger_open(void)
{
    pthread_mutex_lock(&ledger.lock);
    if (ledger.mode == IDLE && !ledger.tried) {
        ledger.tried = true;
        connect_ledger();
        if (ledger.mode == IDLE) {
            /* The daemon is away now: the watcher connects once it is back (a device held to a compute share alone
             * never reserves, yet shares its duty cycle through the ledger's page). */
            start_watcher();
        }
    }
    pthread_mutex_unlock(&ledger.lock);
}

/* -- what this process holds --------------------------------------------------------------------------------- */

static bool valid(int slice, uint32_t heap, int64_t size)
{
    return slice >= 0 && slice < ledger.count && heap < LEDGER_HEAPS && size >= 0;
}

/* This process's own counts, on the private page. Held: the lock. */
static void own_change(int slice, uint32_t heap, int64_t delta)
{
    struct ledger_shared_slice *own = &ledger.private_page->slice[slice];
    int64_t total = clamped(atomic_load(&own->total));
    int64_t usage = clamped(atomic_load(&own->heap_usage[heap]));
    atomic_store(&own->total, delta > 0 ? sum(total, delta) : clamped(total + delta));
    atomic_store(&own->heap_usage[heap], delta > 0 ? sum(usage, delta) : clamped(usage + delta));
}

static void pause_for_retry(void)
{
    struct timespec pause = {.tv_sec = 0, .tv_nsec = RETRY_NS};
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
    }
}

/* Until the daemon answers op (RESERVE or HOLD), for at most GPUPPETTI_VK_LEDGER_WAIT_MS: the lock is let go between
 * tries, so that frees go on meanwhile. Returns 1 (OK), 0 (REFUSED), -1 (no answer), or -2 (no ledger any more: the
 * process is held alone). Held: the lock, on entry and on return. */
static int ask_waiting(uint32_t op, int slice, uint32_t heap, int64_t size, struct ledger_key key, bool spare)
{
    int64_t deadline = sum(now_ns(), ledger.wait_ns);
    for (;;) {
        if (ledger.mode == IDLE) {
            connect_ledger();
        }
        if (ledger.mode == PRIVATE) {
            return -2;
        }
        if (spare && ledger.slices[slice].spare[heap] >= size) {
            return 1;
        }
        if (spare) {
            /* The budget is the slice's, whatever the heap: what is spare on its other heaps goes back first,
             * ahead of the reservation on the same connection. */
            for (uint32_t other = 0; other < LEDGER_HEAPS && ledger.mode == CONNECTED; other++) {
                int64_t *kept = &ledger.slices[slice].spare[other];
                if (other != heap && *kept > 0) {
                    int64_t given = *kept;
                    *kept = 0;
                    tell(request(LEDGER_RELEASE, slice, other, given, (struct ledger_key){0, 0}));
                }
            }
        }
        int64_t need = spare ? size - ledger.slices[slice].spare[heap] : size;
        struct ledger_answer answer;
        if (ask(request(op, slice, heap, need, key), &answer)) {
            return answer.status == LEDGER_OK ? 1 : 0;
        }
        if (now_ns() >= deadline) {
            return -1;
        }
        pthread_mutex_unlock(&ledger.lock);
        pause_for_retry();
        pthread_mutex_lock(&ledger.lock);
    }
}

static bool reserve_private(struct slice_state *state, int slice, uint32_t heap, int64_t size)
{
    int64_t total = clamped(atomic_load(&ledger.private_page->slice[slice].total));
    if (state->budget > 0 && size > state->budget - (total < state->budget ? total : state->budget)) {
        return false;
    }
    state->held[heap] = sum(state->held[heap], size);
    own_change(slice, heap, size);
    return true;
}

bool ledger_reserve(int slice, uint32_t heap, int64_t size)
{
    if (!valid(slice, heap, size)) {
        return false; /* no memory left to count in: nothing can be held to the budget */
    }
    pthread_mutex_lock(&ledger.lock);
    struct slice_state *state = &ledger.slices[slice];
    bool granted;
    if (ledger.mode == PRIVATE) {
        granted = reserve_private(state, slice, heap, size);
    } else if (state->spare[heap] >= size) {
        state->spare[heap] -= size;
        state->held[heap] = sum(state->held[heap], size);
        own_change(slice, heap, size);
        granted = true;
    } else {
        int answer = ask_waiting(LEDGER_RESERVE, slice, heap, size, (struct ledger_key){0, 0}, true);
        if (answer == -2) {
            granted = reserve_private(state, slice, heap, size);
        } else {
            granted = answer == 1;
            if (granted) {
                /* What the spare lacked was reserved: the spare is spent. */
                int64_t from_spare = state->spare[heap] < size ? state->spare[heap] : size;
                state->spare[heap] -= from_spare;
                state->held[heap] = sum(state->held[heap], size);
                own_change(slice, heap, size);
            }
        }
    }
    pthread_mutex_unlock(&ledger.lock);
    return granted;
}

void ledger_release(int slice, uint32_t heap, int64_t size)
{
    if (!valid(slice, heap, size)) {
        return;
    }
    pthread_mutex_lock(&ledger.lock);
    struct slice_state *state = &ledger.slices[slice];
    int64_t taken = state->held[heap] < size ? state->held[heap] : size;
    state->held[heap] -= taken;
    own_change(slice, heap, -taken);
    if (ledger.mode == CONNECTED) {
        /* Kept for the next reservations, up to LEDGER_SPARE_MAX on the slice; the rest given back. */
        state->spare[heap] += taken;
        int64_t spare = 0;
        for (int h = 0; h < LEDGER_HEAPS; h++) {
            spare = sum(spare, state->spare[h]);
        }
        if (spare > LEDGER_SPARE_MAX) {
            int64_t excess = spare - LEDGER_SPARE_MAX;
            if (excess > state->spare[heap]) {
                excess = state->spare[heap];
            }
            state->spare[heap] -= excess;
            tell(request(LEDGER_RELEASE, slice, heap, excess, (struct ledger_key){0, 0}));
        }
    }
    pthread_mutex_unlock(&ledger.lock);
}

static struct object *find(struct ledger_key key)
{
    for (struct object *object = ledger.objects; object != NULL; object = object->next) {
        if (object->key.dev == key.dev && object->key.ino == key.ino) {
            return object;
        }
    }
    return NULL;
}

static struct object *add_object(struct ledger_key key, int slice, uint32_t heap, int64_t size)
{
    struct object *object = malloc(sizeof *object);
    if (object != NULL) {
        *object = (struct object){.next = ledger.objects, .key = key, .slice = slice, .heap = heap, .size = size,
                                  .refs = 1};
        ledger.objects = object;
    }
    return object;
}

bool ledger_export(int slice, uint32_t heap, int64_t size, struct ledger_key key)
{
    if (!valid(slice, heap, size)) {
        return false;
    }
    pthread_mutex_lock(&ledger.lock);
    struct slice_state *state = &ledger.slices[slice];
    struct object *object = NULL;
    /* An object this process holds already is charged already: this allocation stays a reservation. */
    if (find(key) == NULL) {
        int64_t moved = state->held[heap] < size ? state->held[heap] : size;
        object = add_object(key, slice, heap, moved);
        if (object != NULL) {
            state->held[heap] -= moved;
            tell(request(LEDGER_EXPORT, slice, heap, moved, key));
        }
    }
    pthread_mutex_unlock(&ledger.lock);
    return object != NULL;
}

bool ledger_hold(int slice, uint32_t heap, int64_t size, struct ledger_key key)
{
    if (!valid(slice, heap, size)) {
        return false;
    }
    pthread_mutex_lock(&ledger.lock);
    struct object *object = find(key);
    bool held = false;
    if (object != NULL) {
        /* This process holds it already (it exported it, or imported it before): counted once. */
        object->refs++;
        held = true;
    } else if (ledger.mode != PRIVATE &&
               ask_waiting(LEDGER_HOLD, slice, heap, size, key, false) == 1) {
        /* Another thread may have imported it too while this one waited for the daemon. */
        object = find(key);
        if (object != NULL) {
            object->refs++;
            held = true;
        } else if ((object = add_object(key, slice, heap, size)) != NULL) {
            own_change(slice, heap, size);
            held = true;
        } else {
            tell(request(LEDGER_UNHOLD, slice, heap, 0, key));
        }
    }
    pthread_mutex_unlock(&ledger.lock);
    return held;
}

void ledger_unhold(struct ledger_key key)
{
    pthread_mutex_lock(&ledger.lock);
    struct object **link = &ledger.objects;
    while (*link != NULL && ((*link)->key.dev != key.dev || (*link)->key.ino != key.ino)) {
        link = &(*link)->next;
    }
    struct object *object = *link;
    if (object != NULL && --object->refs == 0) {
        *link = object->next;
        own_change(object->slice, object->heap, -object->size);
        tell(request(LEDGER_UNHOLD, object->slice, object->heap, 0, key));
        free(object);
    }
    pthread_mutex_unlock(&ledger.lock);
}

/* -- what the slice holds ------------------------------------------------------------------------------------ */

int ledger_compute(int slice, int fallback)
{
    pthread_mutex_lock(&ledger.lock);
    int compute = slice >= 0 && slice < ledger.count && ledger.slices[slice].compute > 0
                      ? ledger.slices[slice].compute : fallback;
    pthread_mutex_unlock(&ledger.lock);
    return compute;
}

int64_t ledger_budget(int slice, int64_t fallback)
{
    pthread_mutex_lock(&ledger.lock);
    int64_t budget = slice >= 0 && slice < ledger.count ? ledger.slices[slice].budget : fallback;
    pthread_mutex_unlock(&ledger.lock);
    return budget;
}

_Atomic(struct ledger_shared_slice *) *ledger_record(int slice)
{
    return slice >= 0 && slice < ledger.count ? &ledger.slices[slice].record : NULL;
}

void ledger_sync(int slice)
{
    if (slice < 0 || slice >= ledger.count) {
        return;
    }
    pthread_mutex_lock(&ledger.lock);
    if (ledger.mode == CONNECTED && ledger.unanswered) {
        /* Reserving nothing is answered after whatever went before it, and changes nothing. */
        struct ledger_answer answer;
        ask(request(LEDGER_RESERVE, slice, 0, 0, (struct ledger_key){0, 0}), &answer);
    }
    pthread_mutex_unlock(&ledger.lock);
}

int64_t ledger_total(int slice)
{
    if (slice < 0 || slice >= ledger.count) {
        return 0;
    }
    return clamped(atomic_load(&atomic_load(&ledger.slices[slice].record)->total));
}

int64_t ledger_heap_usage(int slice, uint32_t heap)
{
    if (slice < 0 || slice >= ledger.count || heap >= LEDGER_HEAPS) {
        return 0;
    }
    return clamped(atomic_load(&atomic_load(&ledger.slices[slice].record)->heap_usage[heap]));
}

int64_t ledger_spare(int slice, uint32_t heap)
{
    if (slice < 0 || slice >= ledger.count || heap > LEDGER_HEAPS) {
        return 0;
    }
    pthread_mutex_lock(&ledger.lock);
    int64_t spare = 0;
    for (uint32_t h = 0; h < LEDGER_HEAPS; h++) {
        if (heap == LEDGER_HEAPS || h == heap) {
            spare = sum(spare, ledger.slices[slice].spare[h]);
        }
    }
    pthread_mutex_unlock(&ledger.lock);
    return spare;
}
