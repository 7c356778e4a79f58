/* A spinlock: the layer links nothing but libc, and holds each lock for a few loads and stores. */
#ifndef GPUPPETTI_SPIN_H
#define GPUPPETTI_SPIN_H

#include <stdatomic.h>

typedef struct { atomic_flag flag; } spin_t;

static inline void spin_lock(spin_t *lock)
{
    while (atomic_flag_test_and_set_explicit(&lock->flag, memory_order_acquire)) {
    }
}

static inline void spin_unlock(spin_t *lock)
{
    atomic_flag_clear_explicit(&lock->flag, memory_order_release);
}

#endif
